/** The SAE tools' results: features per token as chips (or per sequence as tracks), a feature table, steering's clamps. */
import type {AnnotateParams, AnnotateResult, Clamp, FeaturesResult, GenerateResult, SteerParams, TokenAnnotation} from '../generated/types.ts'
import {css, heatmap, ink, legend, sequential} from './charts.ts'
import {fmt, h, percent, showToken} from './dom.ts'
import type {FileLink} from './files.ts'
import {tracksView} from './trackview.ts'

const featureName = (id: number, label: string | null | undefined) => (label ? `#${id} ${label}` : `#${id}`)

/** A chip coloured by `value / max`: pale for a weak activation, dark for the strongest. */
function chip(id: number, label: string | null, value: number, max: number): HTMLElement {
  const color = sequential(max > 0 ? value / max : 0)
  return h(
    'li',
    {
      class: `sae-chip${value > 0 ? '' : ' inactive'}`,
      'data-feature': id,
      'data-value': value,
      style: `background: ${css(color)}; color: ${ink(color)}`,
      title: `${featureName(id, label)}: ${fmt(value)}`,
    },
    h('span', {class: 'sae-id'}, `#${id}`),
    label ? h('span', {class: 'sae-label'}, label) : null,
    h('span', {class: 'sae-value'}, fmt(value, 2)),
  )
}

/**
 * Each prompt token over its features (`top`: the most active; `pick`: the chosen), with its
 * reconstruction error; for `sequences`, each sequence's feature tracks (trackview.ts).
 */
export function annotateView(result: AnnotateResult, params: AnnotateParams, fileLink?: FileLink): Node {
  if (result.sequences) return tracksView(result, params, fileLink)
  return tokensView(result.tokens ?? [], result, params)
}

function tokensView(annotated: TokenAnnotation[], result: AnnotateResult, params: AnnotateParams): Node {
  const pick = params.mode === 'pick'
  const max = Math.max(0, ...annotated.flatMap((t) => t.features.map((f) => f.value)))
  const tokens = annotated.map((t, position) =>
    h(
      'div',
      {class: 'sae-token', 'data-position': position},
      h('span', {class: 'sae-token-text', title: `position ${position}, token id ${t.token_id}`}, showToken(t.token)),
      h(
        'div',
        {class: 'sae-error', title: `reconstruction error ${fmt(t.error)} (${percent(t.relative_error)} of |x|)`},
        h('span', {style: `width: ${(100 * Math.min(1, t.relative_error)).toFixed(1)}%`}),
      ),
      t.features.length
        ? h('ul', {class: 'sae-features'}, t.features.map((f) => chip(f.id, f.label, f.value, max)))
        : h('span', {class: 'muted sae-none'}, 'no active feature'),
    ),
  )
  const parts: Node[] = [
    h(
      'p',
      {class: 'muted'},
      `${result.sae}, layer ${result.layer}: `,
      pick ? 'the chosen features’ activations at each token' : `each token’s ${params.k ?? 5} most active features`,
      '; the bar under a token is its relative reconstruction error, |x − x̂| / |x| (full: 100% or more).',
    ),
  ]
  if (pick && annotated.length) {
    const ids = annotated[0]!.features
    parts.push(
      heatmap({
        rows: ids.map((f) => featureName(f.id, f.label)),
        cols: annotated.map((t) => showToken(t.token)),
        rowTitle: 'feature',
        colTitle: 'position',
        fill: (r, c) => sequential(max > 0 ? (annotated[c]?.features[r]?.value ?? 0) / max : 0),
        tip: (r, c) => [
          `${featureName(ids[r]!.id, ids[r]!.label)} at position ${c} (${showToken(annotated[c]?.token ?? '')})`,
          `activation ${fmt(annotated[c]?.features[r]?.value ?? NaN)}`,
        ],
      }),
    )
  }
  parts.push(h('div', {class: 'sae-tokens'}, tokens), legend('activation', sequential, 0, 1, '0', fmt(max, 2)))
  return h('div', {class: 'sae-annotate'}, parts)
}

export function featuresView(result: FeaturesResult): Node {
  const shown = result.features.length
  return h(
    'div',
    {},
    h(
      'p',
      {class: 'muted'},
      `${result.sae}, layer ${result.layer}: ${result.total} of ${result.n_features} features`,
      result.total !== result.n_features ? ' match' : '',
      shown ? `; ${result.offset + 1}–${result.offset + shown} shown.` : '; none on this page.',
    ),
    h(
      'table',
      {class: 'table sae-table'},
      h('thead', {}, h('tr', {}, h('th', {}, 'id'), h('th', {}, 'label'), h('th', {}, 'decoder norm'), h('th', {}, 'encoder bias'))),
      h(
        'tbody',
        {},
        result.features.map((f) =>
          h(
            'tr',
            {'data-feature': f.id},
            h('td', {class: 'num'}, String(f.id)),
            h('td', {}, f.label ?? h('span', {class: 'muted'}, '–')),
            h('td', {class: 'num'}, fmt(f.decoder_norm)),
            h('td', {class: 'num'}, fmt(f.encoder_bias)),
          ),
        ),
      ),
    ),
  )
}

/** The clamps a steered generation runs with, shown above its text while it streams and after. */
export function clampsLine(clamps: Clamp[] | undefined): HTMLElement | null {
  if (!Array.isArray(clamps) || !clamps.length) return null
  return h(
    'p',
    {class: 'sae-clamps muted'},
    'Clamped: ',
    clamps.map((c) => h('code', {class: 'sae-clamp', 'data-feature': c.feature_id}, `#${c.feature_id} → ${fmt(c.strength)}`)),
  )
}

export function steerView(generated: (result: GenerateResult, params: SteerParams) => Node, result: GenerateResult, params: SteerParams): Node {
  return h('div', {}, clampsLine(params.clamps), generated(result, params))
}
