/** Each built-in tool's result drawn the way a researcher looks at it; JSON for anything else. */
import type {
  BuiltinTools,
  EmbedResult,
  FillMaskParams,
  FillMaskResult,
  GenerateParams,
  GenerateResult,
  LensGridResult,
  LensLineResult,
  LogitLensResult,
  LoglikelihoodParams,
  LoglikelihoodResult,
  LogprobsResult,
  PatchingResult,
  PredictResult,
  PseudoLoglikelihoodParams,
  PseudoLoglikelihoodResult,
  SaeTools,
  TokenLogprob,
  TokenProb,
  WindowPlan,
} from '../generated/types.ts'
import {bars, css, diverging, heatmap, ink, legend, lineChart, scatter, sequential} from './charts.ts'
import {fmt, h, percent, pos, showToken} from './dom.ts'
import {fileList, resultFiles, type FileLink} from './files.ts'
import {cosines, pca2} from './project.ts'
import {annotateView, clampsLine, featuresView, steerView} from './sae.ts'

export {mounted} from './trackview.ts'

type Tools = BuiltinTools & SaeTools
type Views = {[K in keyof Tools]: (result: Tools[K]['result'], params: Tools[K]['params'], fileLink: FileLink | undefined) => Node}

const VIEWS: Views = {
  generate: generateView,
  loglikelihood: loglikelihoodView,
  logprobs: logprobsView,
  predict: predictView,
  logit_lens: logitLensView,
  lens_line: lensLineView,
  lens_grid: lensGridView,
  activation_patching: patchingView,
  embed: embedView,
  fill_mask: fillMaskView,
  pseudo_loglikelihood: pllView,
  sae_features: featuresView,
  sae_annotate: annotateView,
  sae_steer: (result, params) => steerView(generateView, result, params),
}

/** What goes above a job's streamed tokens: `sae_steer`'s clamps; null for the other tools. */
export function streamHeader(tool: string, params: Record<string, unknown>): Node | null {
  return tool === 'sae_steer' ? clampsLine(params.clamps as Tools['sae_steer']['params']['clamps']) : null
}

/** `tool`'s result drawn; `fileLink` links the files it names, where a view shows them in place of what they hold. */
export function renderResult(tool: string, result: unknown, params: unknown, fileLink?: FileLink): Node {
  const view = (VIEWS as Record<string, ((r: unknown, p: unknown, f: FileLink | undefined) => Node) | undefined>)[tool]
  if (view && result && typeof result === 'object') {
    try {
      return view(result, params, fileLink)
    } catch (error) {
      console.error(`could not draw the ${tool} result`, error)
    }
  }
  return h('pre', {class: 'json'}, JSON.stringify(result, null, 2))
}

// -- text tools --------------------------------------------------------------

function generateView(result: GenerateResult, params: GenerateParams): Node {
  const messages = params.messages ?? []
  const asked = [...messages].reverse().find((m) => m.role === 'user')
  return h(
    'div',
    {class: 'generated'},
    messages.length
      ? h('p', {class: 'muted chat-context'}, `The reply to ${messages.length === 1 ? 'one message' : `${messages.length} messages`}`, asked ? [', the last: ', h('q', {}, asked.content)] : '')
      : null,
    result.completions.map((text, i) =>
      h(
        'p',
        {class: 'completion'},
        h('span', {class: 'prompt'}, params.prompts?.[i] ?? ''),
        h('span', {class: 'completion-text'}, text),
        h('span', {class: 'finish', title: 'finish reason'}, result.finish_reasons[i] ?? ''),
      ),
    ),
    h(
      'p',
      {class: 'muted'},
      `${result.usage.prompt_tokens} prompt + ${result.usage.completion_tokens} generated = ${result.usage.total_tokens} tokens`,
    ),
  )
}

function loglikelihoodView(result: LoglikelihoodResult, params: LoglikelihoodParams): Node {
  const rows = result.ll.map((ll, i) => ({ll, i}))
  return h(
    'div',
    {},
    h(
      'table',
      {class: 'table'},
      h('thead', {}, h('tr', {}, h('th', {}, 'prompt'), h('th', {}, 'continuation'), h('th', {}, 'log-likelihood'), h('th', {}, 'greedy'))),
      h(
        'tbody',
        {},
        rows.map(({ll, i}) =>
          h(
            'tr',
            {},
            h('td', {}, params.prompts[i] ?? ''),
            h('td', {class: 'mono'}, showToken(params.continuations[i] ?? '')),
            h('td', {class: 'num'}, fmt(ll)),
            h('td', {}, result.is_greedy[i] ? '✓' : '–'),
          ),
        ),
      ),
    ),
    h('p', {class: 'muted'}, 'Probability of each continuation (e^ll), relative to the most likely:'),
    bars(
      rows.map(({ll, i}) => ({label: showToken(params.continuations[i] ?? ''), value: Math.exp(ll - Math.max(...result.ll)), text: fmt(ll)})),
      1,
    ),
  )
}

/**
 * Per text: its tokens, each shaded by its probability given those before it (the first has none)
 * and hovered for its log-probability and the alternatives; the sum, and the greedy next token if asked.
 */
function logprobsView(result: LogprobsResult, _params: unknown, fileLink: FileLink | undefined): Node {
  const alternatives = (top: TokenLogprob[] | null | undefined) =>
    (top ?? []).map((t, k) => `\n${k + 1}. ${showToken(t.text)}  ${fmt(t.logprob)}`).join('')
  if (result.files?.length) return logprobsFileView(result, fileLink, alternatives)
  return h(
    'div',
    {class: 'logprobs'},
    result.sequences.map((seq, i) => {
      const scored = (seq.logprobs ?? []).filter((lp): lp is number => lp !== null)
      const sum = scored.reduce((a, b) => a + b, 0)
      const next = seq.next_token
      return h(
        'section',
        {class: 'logprob-text', 'data-text': i},
        h(
          'p',
          {class: 'logprob-tokens mono'},
          (seq.tokens ?? []).map((token, t) => {
            const lp = seq.logprobs?.[t]
            const fill = lp === null || lp === undefined ? null : sequential(Math.exp(lp))
            return h(
              'span',
              {
                class: 'logprob-token',
                'data-position': t,
                style: fill ? `background: ${css(fill)}; color: ${ink(fill)}` : null,
                title: `position ${t}: ${showToken(token)} (id ${seq.token_ids?.[t]})\n${
                  lp === null || lp === undefined ? 'the first token: nothing before it to score it' : `log p = ${fmt(lp)} (${percent(Math.exp(lp))})`
                }${t > 0 ? alternatives(seq.top?.[t - 1]) : ''}`,
              },
              showToken(token),
            )
          }),
        ),
        h(
          'p',
          {class: 'muted'},
          `log p = ${fmt(sum)} over ${scored.length} tokens${scored.length ? ` (${fmt(sum / scored.length)} per token)` : ''}`,
          next ? ['; greedy next token ', h('code', {class: 'next-token', title: alternatives(seq.next_top).trim()}, showToken(next.text)), ` (log p ${fmt(next.logprob)})`] : '',
        ),
      )
    }),
    legend('probability', sequential, 0, 1, '0', '1'),
  )
}

/** Scores written to a file (asked for, or too many for one event): each text's length, plan and next token, and the file. */
function logprobsFileView(
  result: LogprobsResult,
  fileLink: FileLink | undefined,
  alternatives: (top: TokenLogprob[] | null | undefined) => string,
): Node {
  const files = resultFiles(result)
  return h(
    'div',
    {class: 'logprobs-files'},
    h('p', {class: 'muted'}, `Every token's log-probability, a line each, written to ${files.length === 1 ? 'a file' : 'files'} rather than sent in the result.`),
    h(
      'ul',
      {class: 'logprobs-texts'},
      result.sequences.map((seq, i) =>
        h(
          'li',
          {'data-text': i},
          h('span', {class: 'muted'}, `text ${i + 1}: `),
          `${seq.length ?? 0} tokens`,
          seq.plan ? ['; ', planText(seq.plan)] : '',
          seq.next_token ? ['; greedy next token ', h('code', {class: 'next-token', title: alternatives(seq.next_top).trim()}, showToken(seq.next_token.text))] : '',
        ),
      ),
    ),
    fileList(files, fileLink),
  )
}

const tokenBars = (predictions: TokenProb[]) => bars(predictions.map((p) => ({label: showToken(p.text), value: p.prob, text: percent(p.prob)})))

function predictView(result: PredictResult): Node {
  return tokenBars(result.predictions)
}

// -- the lens ----------------------------------------------------------------

/** Layers top to bottom: the last layer (the model's own output) on top, as the residual stream rises. */
const layerRows = (layers: number[]) => layers.map((_, i) => layers.length - 1 - i)

function logitLensView(result: LogitLensResult): Node {
  const rows = layerRows(result.layers)
  const cols = result.positions.map((p) => showToken(result.tokens[p] ?? ''))
  const tracked = Object.keys(result.tracked ?? {})
  const modes = ['top-1 probability', ...(result.entropy ? ['entropy'] : []), ...tracked.map((t) => `p(${showToken(t)})`)]
  const maxEntropy = Math.max(1e-9, ...(result.entropy ?? []).flat())
  const holder = h('div', {})
  const draw = (mode: number) => {
    const fill = (r: number, c: number) => {
      const l = rows[r]!
      if (mode === 0) return sequential(result.topk[l]?.[c]?.[0]?.prob ?? 0)
      if (mode === 1 && result.entropy) return sequential((result.entropy[l]?.[c] ?? 0) / maxEntropy)
      const token = tracked[mode - (result.entropy ? 2 : 1)]!
      return sequential(result.tracked?.[token]?.[l]?.[c] ?? 0)
    }
    const scale =
      mode === 1 && result.entropy
        ? legend('entropy (nats)', sequential, 0, 1, '0', fmt(maxEntropy, 2))
        : legend(modes[mode]!, sequential, 0, 1, '0', '1')
    holder.replaceChildren(
      heatmap({
        rows: rows.map((l) => `L${result.layers[l]}`),
        cols,
        rowTitle: 'layer',
        colTitle: 'position',
        fill,
        text: (r, c) => showToken(result.topk[rows[r]!]?.[c]?.[0]?.text ?? ''),
        tip: (r, c) => {
          const l = rows[r]!
          const position = result.positions[c]!
          return [
            `layer ${result.layers[l]}, position ${position} (${showToken(result.tokens[position] ?? '')})`,
            ...(result.topk[l]?.[c] ?? []).map((t, k) => `${k + 1}. ${showToken(t.text)}  ${percent(t.prob)}`),
            ...(result.entropy ? [`entropy ${fmt(result.entropy[l]?.[c] ?? NaN)} nats`] : []),
            ...tracked.map((t) => `p(${showToken(t)}) = ${percent(result.tracked?.[t]?.[l]?.[c] ?? 0)}`),
          ]
        },
      }),
      scale,
    )
  }
  draw(0)
  const picker =
    modes.length > 1
      ? h(
          'label',
          {class: 'inline'},
          'colour by ',
          h(
            'select',
            {onchange: (e: Event) => draw(Number((e.target as HTMLSelectElement).value))},
            modes.map((m, i) => h('option', {value: i}, m)),
          ),
        )
      : null
  return h('div', {class: 'lens'}, h('p', {class: 'muted'}, 'Top token at each layer × position; hover or tap a cell for the top ', String(result.topk[0]?.[0]?.length ?? ''), '.'), picker, holder)
}

function statColor(stat: string, values: number[][]): {fill: (v: number) => ReturnType<typeof sequential>; legend: HTMLElement} {
  if (stat === 'rank') {
    const max = Math.max(2, ...values.flat())
    const t = (v: number) => 1 - Math.log(v) / Math.log(max) // rank 1 darkest
    return {fill: (v) => sequential(t(v)), legend: legend('rank (log scale)', (x) => sequential(1 - x), 0, 1, '1', fmt(max))}
  }
  if (stat === 'entropy') {
    const max = Math.max(1e-9, ...values.flat())
    return {fill: (v) => sequential(v / max), legend: legend('entropy (nats)', sequential, 0, 1, '0', fmt(max, 2))}
  }
  return {fill: sequential, legend: legend('probability', sequential, 0, 1, '0', '1')}
}

function statText(stat: string, v: number): string {
  return stat === 'probability' ? percent(v) : stat === 'rank' ? `rank ${v}` : `${fmt(v)} nats`
}

function lensGridView(result: LensGridResult): Node {
  const rows = layerRows(result.layers)
  const color = statColor(result.stat, result.values)
  return h(
    'div',
    {},
    h('p', {class: 'muted'}, `${result.stat} of the model's final prediction at each position; cells show each layer's top token.`),
    heatmap({
      rows: rows.map((l) => `L${result.layers[l]}`),
      cols: result.tokens.map(showToken),
      rowTitle: 'layer',
      colTitle: 'position',
      fill: (r, c) => color.fill(result.values[rows[r]!]?.[c] ?? NaN),
      text: (r, c) => showToken(result.top_tokens[rows[r]!]?.[c] ?? ''),
      tip: (r, c) => {
        const l = rows[r]!
        return [
          `layer ${result.layers[l]}, position ${result.positions[c]} (${showToken(result.tokens[c] ?? '')})`,
          `target ${showToken(result.targets[c] ?? '')}: ${statText(result.stat, result.values[l]?.[c] ?? NaN)}`,
          `top token ${showToken(result.top_tokens[l]?.[c] ?? '')}`,
        ]
      },
    }),
    color.legend,
    h('p', {class: 'muted'}, 'Final predictions: ', result.targets.map((t) => h('code', {}, showToken(t))), ''),
  )
}

function lensLineView(result: LensLineResult): Node {
  const label = result.stat === 'probability' ? `p(${showToken(result.token)})` : result.stat === 'rank' ? `rank of ${showToken(result.token)}` : 'entropy (nats)'
  return h(
    'div',
    {},
    h('p', {class: 'muted'}, `${label} at position ${result.position}, by layer`),
    lineChart({
      x: result.layers,
      series: [{name: label, y: result.values}],
      xLabel: 'layer',
      yLabel: label,
      ...(result.stat === 'probability' ? {yDomain: [0, 1] as [number, number]} : {}),
      tip: (_, i) => [`layer ${result.layers[i]}`, statText(result.stat, result.values[i] ?? NaN)],
    }),
  )
}

// -- activation patching -----------------------------------------------------

function patchingView(result: PatchingResult): Node {
  const targets = result.target_tokens.map(showToken).join(', ')
  const summary = h(
    'p',
    {class: 'muted'},
    `p(${targets}): clean target run ${percent(result.clean_prob)}, source run ${percent(result.source_prob)}. `,
    'Cells: patched minus clean.',
  )
  const span = Math.max(1e-9, ...result.prob_diff.flat().map(Math.abs))
  const tip = (l: number, c: number) => [
    `layer ${result.layers[l]}, ${result.labels[c] ?? ''}`,
    `Δp = ${(result.prob_diff[l]?.[c] ?? 0) >= 0 ? '+' : ''}${percent(result.prob_diff[l]?.[c] ?? 0)}`,
    `best rank of the targets: ${result.rank[l]?.[c]}`,
  ]
  if (result.positions.length === 1) {
    return h(
      'div',
      {},
      summary,
      lineChart({
        x: result.layers,
        series: [{name: 'Δp', y: result.prob_diff.map((row) => row[0] ?? 0)}],
        xLabel: 'layer',
        yLabel: `Δp(${targets})`,
        tip: (_, i) => tip(i, 0),
      }),
    )
  }
  const rows = layerRows(result.layers)
  return h(
    'div',
    {},
    summary,
    heatmap({
      rows: rows.map((l) => `L${result.layers[l]}`),
      cols: result.labels.map((label) => showToken(label.split('→')[1] ?? label)),
      rowTitle: 'layer',
      colTitle: 'position',
      fill: (r, c) => diverging((result.prob_diff[rows[r]!]?.[c] ?? 0) / span),
      tip: (r, c) => tip(rows[r]!, c),
    }),
    legend('Δp', diverging, -1, 1, `−${percent(span)}`, `+${percent(span)}`),
  )
}

// -- masked LMs --------------------------------------------------------------

/**
 * Per text: the text with each mask showing its top token, then each mask's top-k as bars.
 * The gateway names the mask token, so the masks are found in the text as written; should
 * they not pair up with the fills (the tokenizer read the text otherwise), the text is shown as it is.
 */
function fillMaskView(result: FillMaskResult, params: FillMaskParams): Node {
  return h(
    'div',
    {class: 'fill-mask'},
    result.fills.map((fills, i) => {
      const text = params.texts[i] ?? ''
      const pieces = result.mask_token ? text.split(result.mask_token) : [text]
      const marks = fills.map((fill) =>
        h('mark', {class: 'mask-fill', title: `${result.mask_token} at position ${fill.position}`}, showToken(fill.predictions[0]?.text ?? '?')),
      )
      const filled = pieces.length === fills.length + 1 ? pieces.map((piece, k) => [piece, marks[k]]) : [text]
      return h(
        'section',
        {class: 'fill-text', 'data-text': i},
        h('p', {class: 'mono filled'}, filled),
        fills.map((fill) =>
          h('div', {class: 'mask-site', 'data-position': fill.position}, h('p', {class: 'muted'}, `${result.mask_token} at position ${fill.position}`), tokenBars(fill.predictions)),
        ),
      )
    }),
  )
}

/** At most this many sequences' per-position lines share one chart (one colour each). */
const PLL_LINES = 6

/** A table of each sequence's pseudo-log-likelihood; with `per_position`, each position's log-probability by position. */
function pllView(result: PseudoLoglikelihoodResult, params: PseudoLoglikelihoodParams): Node {
  const name = (i: number) => {
    const sequence = params.sequences[i] ?? `#${i + 1}`
    return sequence.length > 18 ? `${sequence.slice(0, 17)}…` : sequence
  }
  const parts: Node[] = [
    h(
      'table',
      {class: 'table pll'},
      h('thead', {}, h('tr', {}, h('th', {}, 'sequence'), h('th', {}, 'pll'), h('th', {}, 'tokens scored'), h('th', {}, 'pll per token'))),
      h(
        'tbody',
        {},
        result.pll.map((pll, i) =>
          h(
            'tr',
            {},
            h('td', {class: 'mono sequence'}, params.sequences[i] ?? ''),
            h('td', {class: 'num'}, fmt(pll)),
            h('td', {class: 'num'}, String(result.tokens_scored[i] ?? '')),
            h('td', {class: 'num'}, fmt(pll / (result.tokens_scored[i] || 1))),
          ),
        ),
      ),
    ),
    h('p', {class: 'muted'}, 'Pseudo-log-likelihood (nats): the sum over the sequence’s own tokens of log p(token | every other token), each masked in turn.'),
  ]
  const lines = result.per_position?.slice(0, PLL_LINES) ?? []
  if (lines.length) {
    const longest = Math.max(...lines.map((l) => l.length))
    parts.push(
      h(
        'p',
        {class: 'muted'},
        'Each position’s log-probability with it masked',
        result.pll.length > lines.length ? ` (the first ${lines.length} of ${result.pll.length} sequences)` : '',
        ':',
      ),
      lineChart({
        x: Array.from({length: longest}, (_, i) => i),
        series: lines.map((y, i) => ({name: name(i), y})),
        xLabel: 'position',
        yLabel: 'log p (nats)',
        tip: (s, i) => [`${name(s)}, position ${i} (${showToken(result.tokens?.[s]?.[i] ?? '')})`, `log p = ${fmt(lines[s]?.[i] ?? NaN)}`],
      }),
    )
  }
  return h('div', {}, parts)
}

// -- embeddings --------------------------------------------------------------

function embedView(result: EmbedResult, params: {texts: string[]}, fileLink: FileLink | undefined): Node {
  // `none` is the older name of `per_token`: one vector per token, with the tokens.
  const perToken = result.pooling === 'per_token' || result.pooling === 'none'
  if (!result.embeddings) return embedFilesView(result, params, perToken, fileLink)
  const vectors: number[][] = []
  const labels: string[] = []
  const groups: number[] = []
  result.embeddings.forEach((e, i) => {
    if (Array.isArray(e[0])) {
      ;(e as number[][]).forEach((v, t) => {
        vectors.push(v)
        labels.push(showToken(result.tokens?.[i]?.[t] ?? `#${t}`))
        groups.push(i)
      })
    } else {
      vectors.push(e as number[])
      labels.push(params.texts[i] ?? `#${i}`)
      groups.push(0)
    }
  })
  const {points, explained} = pca2(vectors)
  const parts: Node[] = [
    h('p', {class: 'muted'}, `${vectors.length} vectors of ${result.dim} dimensions (layer ${result.layer}, ${result.pooling} pooling), projected on their first two principal components.`),
    scatter({
      points: points.map(([x, y], i) => ({x, y, label: labels[i]!, group: groups[i]!})),
      xLabel: `PC1 (${percent(explained[0])} of variance)`,
      yLabel: `PC2 (${percent(explained[1])})`,
      tip: (i) => [labels[i]!, perToken ? `text ${groups[i]! + 1}: ${params.texts[groups[i]!] ?? ''}` : `vector ${i + 1}`],
    }),
  ]
  if (!perToken && vectors.length > 1 && vectors.length <= 32) {
    const sims = cosines(vectors)
    // Hidden states are often all alike (cosines near 1): colour the range the pairs span.
    const pairs = sims.flatMap((row, r) => row.filter((_, c) => c !== r))
    const [lo, hi] = [Math.min(...pairs), Math.max(...pairs)]
    const t = (v: number) => (hi > lo ? (v - lo) / (hi - lo) : 1)
    parts.push(
      h('p', {class: 'muted'}, 'Cosine similarity:'),
      heatmap({
        rows: labels,
        cols: labels,
        rowTitle: 'text',
        colTitle: 'text',
        fill: (r, c) => (r === c ? null : sequential(t(sims[r]![c]!))),
        text: (r, c) => fmt(sims[r]![c]!, 2),
        tip: (r, c) => [`${labels[r]} · ${labels[c]}`, `cosine ${fmt(sims[r]![c]!)}`],
      }),
      legend('cosine', sequential, 0, 1, fmt(lo, 2), fmt(hi, 2)),
    )
  }
  return h('div', {}, parts)
}

/**
 * Vectors written to files (asked for, or too many for one event): too many to project here, so
 * what they are, how each text was run, and the files to fetch them from.
 */
function embedFilesView(result: EmbedResult, params: {texts: string[]}, perToken: boolean, fileLink: FileLink | undefined): Node {
  const files = resultFiles(result)
  const formats = new Set(files.map((f) => f.format))
  const texts = params.texts.length
  return h(
    'div',
    {class: 'embed-files'},
    h(
      'p',
      {class: 'muted'},
      `${texts === 1 ? 'One text' : `${texts} texts`}: ${perToken ? 'a vector per token' : 'a vector each'} of ${result.dim} dimensions `,
      `(layer ${result.layer}, ${result.pooling} pooling), written to ${files.length === 1 ? 'a file' : 'files'} rather than sent in the result.`,
    ),
    result.plans?.length
      ? h(
          'ul',
          {class: 'embed-plans'},
          result.plans.map((plan, i) => h('li', {'data-text': i}, h('span', {class: 'muted'}, `text ${i + 1}: `), planText(plan))),
        )
      : null,
    files.length ? fileList(files, fileLink) : h('p', {class: 'muted'}, 'The result names no file.'),
    // How to read them, for the formats there are: the vectors cannot be looked at here.
    formats.has('safetensors')
      ? h(
          'p',
          {class: 'muted file-hint'},
          'The .safetensors file holds text i’s vectors as embeddings.i (tokens × dimensions, float32) and their token ids as token_ids.i: ',
          h('code', {}, 'safetensors.numpy.load_file(path)'),
          '.',
        )
      : null,
    formats.has('npy')
      ? h('p', {class: 'muted file-hint'}, 'Each .npy file holds one array (tokens × dimensions for the vectors): ', h('code', {}, "numpy.load(path, mmap_mode='r')"), '.')
      : null,
  )
}

/** A text's windows in words: how many, how long, their overlap and how they were stitched. */
function planText(plan: WindowPlan): string {
  const n = plan.windows.length
  if (n <= 1) return `one window of ${pos(plan.window)} positions`
  return `${pos(n)} windows of ${pos(plan.window)} positions overlapping by ${pos(plan.overlap)}, stitched by ${plan.stitch}`
}
