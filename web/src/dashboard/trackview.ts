/**
 * `sae_annotate` over sequences, as a genome browser shows signal tracks: per sequence, one row per
 * feature over the sequence's positions, drawn on a canvas, with a position ruler and, zoomed in far
 * enough, the sequence's letters. Zoomed out, each pixel column shows the largest activation of the
 * positions it covers (tracks.ts), so a peak never falls between pixels.
 *
 * The canvas is as wide as the view and stays put (sticky) in a scroller whose content is as wide
 * as the whole sequence at the zoom chosen: the scroller's own scrollbar, wheel, trackpad and drag
 * move the window, and only the positions in view are drawn. Zoom: the buttons, ctrl + wheel (a
 * trackpad's pinch), or + / − / 0 on the focused tracks. Positions are shown counted from 1.
 *
 * A sequence run in several windows (`plan`) gets a lane under the ruler with its windows, and its
 * edge-affected positions (tracks.ts, `edgeSides`) shaded in every track: so that a peak or a dip at
 * a window's edge is seen for what it may be.
 *
 * Tracks written to files (`file`, or too big for the result) leave each sequence its features'
 * summaries: those are listed, with each feature's file, and only the ruler and the windows lane are
 * drawn (the plan is still in the result; the per-position context, and so the shading, is not).
 */
import type {AnnotateParams, AnnotateResult, FeatureTrack, SequenceAnnotation} from '../generated/types.ts'
import {hideTip, showTip} from './charts.ts'
import {fmt, h, percent, pos, showToken} from './dom.ts'
import {fileList, resultFiles, type FileLink} from './files.ts'
import {
  argmaxIn,
  barHeights,
  clamp,
  columnRange,
  edgeSides,
  edgeStretches,
  fillPixels,
  LAYOUT,
  LETTER_PX,
  MOST_PX,
  rulerStep,
  stackWindows,
  windowsAt,
  zoomBounds,
  type Context,
  type Pixels,
  type Window,
} from './tracks.ts'

const {ruler: RULER_H, letters: LETTERS_H, track: TRACK_H, pitch: PITCH, bottom: BOTTOM, windows: LANE_H, strip: STRIP_H} = LAYOUT
/** The most rows the windows lane stacks its windows in (more only for an overlap over half the window). */
const LANE_ROWS = 3
/** The scroller's content is at most this wide: past it, scrolling maps onto the sequence proportionally. */
const MAX_SCROLL_W = 8_000_000

const featureName = (f: FeatureTrack) => (f.label ? `#${f.id} ${f.label}` : `#${f.id}`)
/** A sequence's positions: its tokens, or with its tracks in files, its length. */
const positions = (s: SequenceAnnotation | undefined) => s?.tokens?.length ?? s?.length ?? 0

/**
 * A CSS colour as one pixel of ImageData's buffer (read as 32-bit words in the platform's byte order);
 * with `over` and `alpha`, the colour at `alpha` over `over`, as an opaque pixel (the pixels are
 * written, not blended).
 */
const packed = new Map<string, number>()
let probe: CanvasRenderingContext2D | null | undefined
function pack(color: string, over?: string, alpha = 1): number {
  const key = over ? `${color} ${alpha} ${over}` : color
  let word = packed.get(key)
  if (word === undefined) {
    probe ??= h('canvas', {width: 1, height: 1}).getContext('2d', {willReadFrequently: true})
    if (!probe) return 0
    probe.clearRect(0, 0, 1, 1)
    if (over) {
      probe.fillStyle = over
      probe.fillRect(0, 0, 1, 1)
      probe.globalAlpha = alpha
    }
    probe.fillStyle = color
    probe.fillRect(0, 0, 1, 1)
    probe.globalAlpha = 1
    word = new Uint32Array(probe.getImageData(0, 0, 1, 1).data.buffer)[0]!
    packed.set(key, word)
  }
  return word
}

/** Views that draw once they are in the page, at their laid-out size: `mounted` draws them. */
const drawers = new WeakMap<Element, () => void>()

/** Draw the canvases in `root` (just put in the page) now, at their laid-out size, rather than on the next frame. */
export function mounted(root: Node): void {
  if (!(root instanceof Element)) return
  root.getBoundingClientRect() // lays the page out: what is measured is what it takes to show the result
  for (const element of [root, ...root.querySelectorAll('.sae-tracks')]) {
    try {
      drawers.get(element)?.()
    } catch (error) {
      console.error('could not draw the tracks', error)
    }
  }
}

export function tracksView(result: AnnotateResult, params: AnnotateParams, fileLink?: FileLink): HTMLElement {
  const sequences = result.sequences ?? []
  const pick = params.mode === 'pick'
  const threshold = params.threshold ?? 0
  const files = resultFiles(result)
  const filed = sequences.some((s) => !s.tracks)

  // -- state ---------------------------------------------------------------------------------
  let index = 0
  let seq: SequenceAnnotation = sequences[0]!
  let n = positions(seq)
  let maxError = 0
  let sharedMax = 0
  let ppp = 1 // CSS pixels per position
  let start = 0 // the first position in view (fractional, from 0)
  let fitting = true
  let width = 0 // the canvas's CSS width
  let dpr = 1
  let hover: {x: number; y: number; clientX: number; clientY: number} | null = null
  let drag: {x: number; scroll: number; moved: boolean} | null = null
  // A plan of several windows: its windows, each one's row in the lane, each position's context and the edge-affected stretches.
  let windows: readonly Window[] = []
  let stack: {rows: number[]; count: number} = {rows: [], count: 0}
  let context: ArrayLike<Context> = []
  let stretches: [number, number][] = []
  let edgeCount = 0

  // -- the elements --------------------------------------------------------------------------
  const root = h('div', {class: 'sae-tracks', 'data-sequence': 0, 'data-letters': 'hidden'})
  const caption = h(
    'p',
    {class: 'muted'},
    `${result.sae}, layer ${result.layer}: `,
    pick ? 'the chosen features’' : `each sequence’s ${params.k ?? 5} most active features’`,
    filed
      ? [' largest and mean activations; their activations at every position are in the files', threshold ? ` (features.bed: where each is above ${fmt(threshold)})` : '']
      : [' activations at every position', threshold ? `; a dashed line marks the threshold ${fmt(threshold)}` : ''],
    '. Positions count from 1.',
  )
  const number = h('input', {type: 'number', min: 1, max: sequences.length, step: 1, value: 1, class: 'track-index', 'aria-label': 'sequence number'})
  const prev = h('button', {type: 'button', class: 'track-prev', 'aria-label': 'previous sequence'}, '‹')
  const next = h('button', {type: 'button', class: 'track-next', 'aria-label': 'next sequence'}, '›')
  const picker =
    sequences.length > 1
      ? h('div', {class: 'track-picker'}, prev, h('label', {class: 'inline'}, 'sequence ', number, ` of ${sequences.length}`), next)
      : null
  const zoomOut = h('button', {type: 'button', class: 'track-zoom-out', title: 'zoom out (−)', 'aria-label': 'zoom out'}, '−')
  const zoomIn = h('button', {type: 'button', class: 'track-zoom-in', title: 'zoom in (+)', 'aria-label': 'zoom in'}, '+')
  const fitButton = h('button', {type: 'button', class: 'track-fit', title: 'the whole sequence (0)'}, 'fit')
  const sharedBox = h('input', {type: 'checkbox', class: 'track-shared'})
  const sharedLabel = h('label', {class: 'inline', title: 'every track on the scale of the largest activation, not each on its own'}, sharedBox, 'one scale')
  const status = h('span', {class: 'track-status muted'})
  const toolbar = h(
    'div',
    {class: 'track-toolbar'},
    zoomOut,
    zoomIn,
    fitButton,
    sharedLabel,
    status,
  )
  const summary = h('p', {class: 'track-summary muted'})
  // A sequence whose tracks are in files: its features' summaries, each with its track's file.
  const filedBox = h('div', {class: 'track-files', hidden: true})
  const labels = h('div', {class: 'track-labels', style: `padding-top: ${RULER_H}px`})
  const canvas = h('canvas', {class: 'track-canvas', role: 'img'})
  const overlay = h('canvas', {class: 'track-overlay', 'aria-hidden': 'true'})
  const stage = h('div', {class: 'track-stage'}, canvas, overlay)
  const spacer = h('div', {class: 'track-spacer'}, stage)
  const scroller = h(
    'div',
    {
      class: 'track-scroller',
      tabindex: 0,
      'aria-label': 'feature tracks: + and − zoom, 0 fits the whole sequence, the arrow keys, Home and End move',
    },
    spacer,
  )
  const body = h('div', {class: 'track-body'}, labels, scroller)
  const empty = h('p', {class: 'muted track-empty', hidden: true}, 'This sequence has no positions.')
  const hint = h('p', {class: 'muted track-hint'})
  root.append(caption, picker ?? '', toolbar, summary, body, empty, hint, filedBox)

  // -- geometry ------------------------------------------------------------------------------
  const rows = () => (seq.tracks ? seq.features.length + 1 : 0) // the features, then the reconstruction error
  const lane = () => (windows.length ? LANE_H : 0)
  /** The letters' row: none for a sequence whose tokens are not in the result. */
  const lettersH = () => (seq.tokens ? LETTERS_H : 0)
  /** Where the first track's band begins, CSS px from the top. */
  const tracksTop = () => RULER_H + lane() + lettersH()
  const height = () => tracksTop() + rows() * PITCH + BOTTOM
  const visible = () => width / ppp // positions in view
  const contentWidth = () => Math.max(width, Math.min(MAX_SCROLL_W, n * ppp))
  const maxStart = () => Math.max(0, n - visible())
  const fromScroll = (left: number) => {
    const room = contentWidth() - width
    return room > 0 ? (left / room) * maxStart() : 0
  }
  const toScroll = (first: number) => {
    const most = maxStart()
    return most > 0 ? (first / most) * (contentWidth() - width) : 0
  }
  const bounds = () => zoomBounds(width, n, MOST_PX)
  /** Positions per device-pixel column. */
  const per = () => 1 / (ppp * dpr)

  // -- drawing -------------------------------------------------------------------------------
  const colors = () => {
    const style = getComputedStyle(root)
    const v = (name: string, fallback: string) => style.getPropertyValue(name).trim() || fallback
    return {
      text: v('--text', '#1b1f24'),
      muted: v('--muted', '#5c6670'),
      line: v('--line', '#d9dee4'),
      band: v('--bg', '#f6f7f9'),
      bar: v('--accent', '#1f6feb'),
      error: v('--warn', '#9a6700'),
    }
  }
  /** The plan in words, for the summary, the canvas's label and the lane's title. */
  const planText = () => {
    const plan = seq.plan!
    return `${pos(windows.length)} windows of ${pos(plan.window)} positions overlapping by ${pos(plan.overlap)}, stitched by ${plan.stitch}`
  }
  const edgeRule = () => `less than half the overlap (${fmt(seq.plan!.overlap / 2, 1)}) of context on a side where the sequence goes on`

  const drawLabels = () => {
    labels.replaceChildren(
      windows.length
        ? h(
            'div',
            {
              class: 'track-label track-windows-label',
              style: `height: ${LANE_H}px`,
              title: `the windows the sequence ran in (${planText()}), stacked where they overlap${context.length ? `; under them, the edge-affected positions: ${edgeRule()}` : ''}`,
            },
            h('span', {class: 'track-name'}, 'windows'),
          )
        : '',
      h('div', {style: `height: ${lettersH()}px`}),
      ...(seq.tracks ? seq.features : []).map((f, i) =>
        h(
          'div',
          {
            class: `track-label${f.max > 0 ? '' : ' inactive'}`,
            'data-feature': f.id,
            'data-row': i,
            style: `height: ${PITCH}px`,
            title: `${featureName(f)}: max ${fmt(f.max)} at position ${pos(f.argmax + 1)}, mean ${fmt(f.mean)}${f.above ? `; ${pos(f.above.length)} of ${pos(n)} positions above ${fmt(threshold)}` : ''}`,
          },
          h('span', {class: 'track-name'}, h('span', {class: 'sae-id'}, `#${f.id}`), f.label ? ` ${f.label}` : ''),
          h('span', {class: 'track-max'}, f.max > 0 ? `max ${fmt(f.max, 2)}` : 'never active'),
        ),
      ),
      seq.tracks
        ? h(
            'div',
            {class: 'track-label track-error-label', 'data-row': seq.features.length, style: `height: ${PITCH}px`, title: 'relative reconstruction error, |x − x̂| / |x|, at each position'},
            h('span', {class: 'track-name'}, 'rel. error'),
            h('span', {class: 'track-max'}, `max ${percent(maxError)}`),
          )
        : '',
    )
    const active = seq.features.filter((f) => f.max > 0).length
    summary.textContent = `${seq.name ? `${seq.name}: ` : ''}${pos(n)} positions; ${seq.features.length} feature${seq.features.length === 1 ? '' : 's'}${
      seq.features.length ? `, ${active} active somewhere` : pick ? '' : ' (none is active anywhere)'
    }.${windows.length ? ` Run in ${planText()}. ${edgeText()}.` : ''}`
    drawFiled()
  }
  const edgeText = () =>
    !context.length
      ? 'Its per-position context is not in the result, so no position is marked edge-affected'
      : edgeCount
        ? `Shaded: ${pos(edgeCount)} edge-affected position${edgeCount === 1 ? '' : 's'} in ${pos(stretches.length)} stretch${stretches.length === 1 ? '' : 'es'}, with ${edgeRule()}`
        : `No position is edge-affected (${edgeRule()})`

  /** The sequence's features in a table, each with its bigWig, and where the rest of its tracks are. */
  const drawFiled = () => {
    filedBox.hidden = !!seq.tracks
    if (seq.tracks) return filedBox.replaceChildren()
    const byName = new Map(files.map((f) => [f.name, f]))
    const link = (name: string) => {
      const file = byName.get(name)
      return file && fileLink ? fileLink(file) : h('code', {}, name)
    }
    const others = files.filter((f) => !/^f\d+\.bw$/.test(f.name))
    filedBox.replaceChildren(
      h(
        'p',
        {class: 'muted'},
        `Its tracks are in the job’s files: a bigWig per feature and one of the relative reconstruction error, and a BED of where each feature is above the threshold, `,
        `each sequence a chromosome${seq.name ? ` (this one ${seq.name})` : ''}. They open in a genome browser such as IGV or JBrowse.`,
      ),
      h(
        'table',
        {class: 'table track-features'},
        h('thead', {}, h('tr', {}, h('th', {}, 'feature'), h('th', {}, 'max'), h('th', {}, 'mean'), h('th', {}, 'at position'), h('th', {}, 'track'))),
        h(
          'tbody',
          {},
          seq.features.map((f) =>
            h(
              'tr',
              {'data-feature': f.id, class: f.max > 0 ? null : 'inactive'},
              h('td', {}, h('span', {class: 'sae-id'}, `#${f.id}`), f.label ? ` ${f.label}` : ''),
              h('td', {class: 'num'}, f.max > 0 ? fmt(f.max) : 'never active'),
              h('td', {class: 'num'}, fmt(f.mean)),
              h('td', {class: 'num'}, f.max > 0 ? pos(f.argmax + 1) : '–'),
              h('td', {}, link(`f${f.id}.bw`)),
            ),
          ),
        ),
      ),
      others.length ? fileList(others, fileLink) : '',
    )
  }

  const describe = (first: number, last: number) => {
    if (!seq.tracks) {
      return `Windows of sequence ${index + 1}${seq.name ? ` (${seq.name})` : ''}: ${pos(n)} positions, ${pos(first)} to ${pos(last)} shown; run in ${planText()}. Its tracks are in files.`
    }
    const ranked = [...seq.features].sort((a, b) => b.max - a.max).filter((f) => f.max > 0)
    const shown = ranked.slice(0, 6).map((f) => `${featureName(f)} peaks at ${fmt(f.max)} at position ${pos(f.argmax + 1)}`)
    return (
      `Feature tracks${sequences.length > 1 ? ` of sequence ${index + 1} of ${sequences.length}` : ''}: ${seq.features.length} features over ${pos(n)} positions, ` +
      `${pos(first)} to ${pos(last)} shown${ppp >= LETTER_PX ? ' with their letters' : ''}. ` +
      (shown.length ? `${shown.join('; ')}${ranked.length > shown.length ? `; ${ranked.length - shown.length} more active` : ''}. ` : 'No feature is active. ') +
      `Relative reconstruction error up to ${percent(maxError)}.` +
      (windows.length ? ` Run in ${planText()}. ${edgeText()}.` : '')
    )
  }

  /** Size the canvases to the scroller (false while it has no width: not in the page, or hidden). */
  const measure = (): boolean => {
    const w = scroller.clientWidth
    if (w <= 0) return false
    const ratio = window.devicePixelRatio || 1
    const tall = height()
    if (w !== width || ratio !== dpr || canvas.height !== Math.round(tall * ratio)) {
      width = w
      dpr = ratio
      for (const c of [canvas, overlay]) {
        c.width = Math.round(width * dpr)
        c.height = Math.round(tall * dpr)
        c.style.width = `${width}px`
        c.style.height = `${tall}px`
      }
      stage.style.width = `${width}px`
      stage.style.height = `${tall}px`
    }
    const [fit, most] = bounds()
    ppp = fitting ? fit : clamp(ppp, fit, most)
    fitting = ppp <= fit * (1 + 1e-9)
    spacer.style.width = `${contentWidth()}px`
    spacer.style.height = `${tall}px`
    return true
  }

  let image: ImageData | undefined
  const draw = () => {
    if (!n || !measure()) return
    start = clamp(start, 0, maxStart())
    const ctx = canvas.getContext('2d')
    if (!ctx) return
    const c = colors()
    const columns = canvas.width
    const across = per()
    const first = Math.floor(start)
    const last = Math.min(n, Math.ceil(start + visible()))
    const x = (p: number) => (p - start) * ppp // a position's left edge, CSS px
    const dev = (cssPx: number) => Math.round(cssPx * dpr)
    const letters = ppp >= LETTER_PX

    // Bands, bars and lines straight into the pixels (one putImageData: thousands of bars cost
    // little), then the text on top with the canvas's own drawing.
    if (image?.width !== canvas.width || image.height !== canvas.height) image = ctx.createImageData(canvas.width, canvas.height)
    const pixels: Pixels = {data: new Uint32Array(image.data.buffer), width: image.width, height: image.height}
    pixels.data.fill(0)
    const line = pack(c.line)
    fillPixels(pixels, 0, dev(RULER_H) - 1, columns, dev(RULER_H), line)
    // The device columns each edge-affected stretch in view takes: at least one, however far out.
    const shaded: [number, number][] = []
    for (const [a, b] of stretches) {
      if (b <= first || a >= last) continue
      const left = dev(x(a))
      shaded.push([left, Math.max(left + 1, dev(x(b)))])
    }
    if (windows.length) {
      // The windows, alternately shaded, each in its row of the stack; the strip under them.
      const shades = [pack(c.muted, c.band, 0.35), pack(c.muted, c.band, 0.7)]
      const tall = (LANE_H - STRIP_H - 4) / stack.count
      for (const [i, [a, b]] of windows.entries()) {
        if (b <= first || a >= last) continue
        const left = dev(x(a))
        const y = RULER_H + 1 + stack.rows[i]! * tall
        fillPixels(pixels, left, dev(y), Math.max(left + 1, dev(x(b))), dev(y + tall) - (tall >= 4 ? 1 : 0), shades[i % 2]!)
      }
      const strip = pack(c.error)
      for (const [left, right] of shaded) fillPixels(pixels, left, dev(RULER_H + LANE_H - STRIP_H - 1), right, dev(RULER_H + LANE_H - 1), strip)
    }
    if (!letters && seq.tokens) {
      const lettersY = RULER_H + lane() + LETTERS_H / 2
      fillPixels(pixels, dev(Math.max(0, x(0))), dev(lettersY - 1.5), dev(Math.min(width, x(n))), dev(lettersY + 1.5), line)
    }
    const band = pack(c.band)
    const edgeBand = pack(c.error, c.band, 0.22)
    for (let r = 0; r < rows(); r++) {
      const isError = r === seq.features.length
      const values: ArrayLike<number> = (isError ? seq.relative_error : seq.tracks?.[r]) ?? []
      const top = isError ? maxError : sharedBox.checked ? sharedMax : (seq.features[r]?.max ?? 0)
      const y0 = dev(tracksTop() + r * PITCH)
      const base = dev(tracksTop() + r * PITCH + TRACK_H)
      fillPixels(pixels, 0, y0, columns, base, band)
      for (const [left, right] of shaded) fillPixels(pixels, left, y0, right, base, edgeBand)
      const heights = barHeights(values, start, across, columns, top, base - y0, ppp >= 4)
      const color = pack(isError ? c.error : c.bar)
      for (let col = 0; col < columns; col++) {
        for (let i = (base - heights[col]!) * columns + col, end = base * columns; i < end; i += columns) pixels.data[i] = color
      }
      if (threshold > 0 && !isError && threshold < top) {
        const ty = base - Math.round((threshold / top) * (base - y0))
        const dash = pack(c.muted)
        for (let col = 0; col < columns; col += dev(6)) fillPixels(pixels, col, ty, col + dev(3), ty + 1, dash)
      }
      fillPixels(pixels, 0, base, columns, base + 1, line)
    }
    ctx.putImageData(image, 0, 0)

    // The ruler: labelled ticks at least 80 px apart, at the centres of their positions.
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0)
    const step = rulerStep(80 / ppp)
    ctx.font = '11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace'
    ctx.textBaseline = 'alphabetic'
    ctx.textAlign = 'left'
    ctx.fillStyle = c.muted
    for (let q = Math.max(step, Math.ceil((first + 1) / step) * step); q <= last; q += step) {
      const at = x(q - 1) + ppp / 2
      if (at < 0 || at > width) continue
      ctx.fillRect(Math.round(at * dpr) / dpr, RULER_H - 6, 1, 5)
      const label = pos(q)
      const w = ctx.measureText(label).width
      ctx.fillText(label, clamp(at - w / 2, 0, width - w), RULER_H - 8)
    }

    // The letters, where there is room: one per position, a longer token cut short.
    const tokens = seq.tokens
    if (letters && tokens) {
      ctx.font = '12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace'
      ctx.textAlign = 'center'
      ctx.textBaseline = 'middle'
      ctx.fillStyle = c.text
      const fits = Math.max(1, Math.floor(ppp / ctx.measureText('M').width))
      for (let p = first; p < last; p++) {
        const token = showToken(tokens[p] ?? '')
        const text = token.length <= fits ? token : fits > 1 ? `${token.slice(0, fits - 1)}…` : token.slice(0, 1)
        ctx.fillText(text, x(p) + ppp / 2, RULER_H + lane() + LETTERS_H / 2)
      }
    }

    root.dataset.letters = letters && tokens ? 'shown' : 'hidden'
    root.dataset.pxPerPosition = String(ppp)
    root.dataset.start = String(start)
    root.dataset.first = String(first + 1)
    root.dataset.last = String(last)
    status.textContent = `positions ${pos(first + 1)}–${pos(last)} of ${pos(n)}${letters || !tokens ? '' : ` · letters from ${LETTER_PX} px per position`}${
      sharedBox.checked ? ` · one scale, 0 to ${fmt(sharedMax, 2)}` : ''
    }`
    canvas.setAttribute('aria-label', describe(first + 1, last))
    zoomIn.disabled = ppp >= bounds()[1] * (1 - 1e-9)
    zoomOut.disabled = fitting
    fitButton.disabled = fitting
    drawHover()
  }

  /** The guide line and the tooltip for the pointer's place, after a move or a redraw. */
  const drawHover = () => {
    const ctx = overlay.getContext('2d')
    if (!ctx) return
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0)
    ctx.clearRect(0, 0, width, height())
    if (!hover || drag?.moved) {
      delete root.dataset.hoverPosition
      return hideTip()
    }
    const column = Math.floor(hover.x * dpr)
    const [from, to] = columnRange(start, per(), column, n)
    if (from >= n || hover.x < 0 || hover.x >= width) {
      delete root.dataset.hoverPosition
      return hideTip()
    }
    const row = Math.floor((hover.y - tracksTop()) / PITCH)
    const onTrack = row >= 0 && row < rows() && hover.y - tracksTop() - row * PITCH <= TRACK_H
    const onLane = windows.length > 0 && hover.y >= RULER_H && hover.y < RULER_H + lane()
    const isError = row === seq.features.length
    const values: ArrayLike<number> | undefined = !onTrack ? undefined : isError ? seq.relative_error : seq.tracks?.[row]
    const [at, value] = values ? argmaxIn(values, from, to) : [from, NaN]
    const guide = per() > 1 ? (column + 0.5) / dpr : (at - start + 0.5) * ppp
    ctx.fillStyle = colors().text
    ctx.globalAlpha = 0.55
    ctx.fillRect(Math.round(guide * dpr) / dpr, RULER_H, 1 / dpr, height() - RULER_H - BOTTOM)
    ctx.globalAlpha = 1
    if (onTrack) {
      ctx.strokeStyle = colors().text
      ctx.lineWidth = 1
      ctx.strokeRect(0.5, tracksTop() + row * PITCH - 0.5, width - 1, TRACK_H + 1)
    }
    const lines = [`position ${pos(at + 1)} of ${pos(n)}${seq.tokens ? `: ${showToken(seq.tokens[at] ?? '')}` : ''}`]
    if (onTrack && isError) lines.push(`relative error ${percent(value)}`)
    else if (onTrack) lines.push(`${featureName(seq.features[row]!)}: activation ${fmt(value)}`)
    const here = windows.length ? context[at] : undefined
    if (onLane) {
      const held = windowsAt(windows, at)
      lines.push(...held.map((i) => `window ${pos(i + 1)} of ${pos(windows.length)}: positions ${pos(windows[i]![0] + 1)}–${pos(windows[i]![1])}`))
      if (here) lines.push(`context: ${pos(here[0])} left, ${pos(here[1])} right`)
    }
    if (here) {
      const [left, right] = edgeSides(here, at, n, seq.plan!.overlap)
      // Short: the tip is a few words wide.
      const sides = left && right ? 'both sides' : left ? 'left' : right ? 'right' : ''
      if (sides) lines.push(`edge-affected: ${sides}, < ${fmt(seq.plan!.overlap / 2, 1)} context`)
    }
    if (to - from > 1) lines.push(onTrack ? `the largest of positions ${pos(from + 1)}–${pos(to)}, one pixel wide here` : `this pixel: positions ${pos(from + 1)}–${pos(to)}`)
    root.dataset.hoverPosition = String(at + 1)
    showTip(lines, hover.clientX, hover.clientY)
  }

  // -- moving about ----------------------------------------------------------------------------
  /** Show from position `first` (fractional), keeping the scroller's place in step. */
  const moveTo = (first: number) => {
    start = clamp(first, 0, maxStart())
    scroller.scrollLeft = toScroll(start)
    // What the scroller took (it rounds to its own pixels) is where the view is: a scroll event then changes nothing.
    start = clamp(fromScroll(scroller.scrollLeft), 0, maxStart())
    draw()
  }
  /** Zoom to `px` pixels per position, the position under `anchor` (CSS px from the left, default the middle) kept there. */
  const zoomTo = (px: number, anchor = width / 2) => {
    if (!width) return
    const under = start + anchor / ppp
    const [fit, most] = bounds()
    ppp = clamp(px, fit, most)
    fitting = ppp <= fit * (1 + 1e-9)
    spacer.style.width = `${contentWidth()}px`
    moveTo(under - anchor / ppp)
  }
  const fit = () => {
    fitting = true
    ppp = bounds()[0]
    spacer.style.width = `${contentWidth()}px`
    moveTo(0)
  }
  const show = (i: number) => {
    index = clamp(Math.round(i), 0, sequences.length - 1)
    seq = sequences[index]!
    n = positions(seq)
    maxError = seq.relative_error ? argmaxIn(seq.relative_error, 0, n)[1] || 0 : 0
    sharedMax = Math.max(0, ...seq.features.map((f) => f.max))
    const plan = seq.plan
    // The generated types cannot say what the windows and context hold: [start, end) and [left, right] pairs.
    windows = plan && plan.windows.length > 1 ? (plan.windows as unknown as Window[]) : []
    context = windows.length && Array.isArray(seq.context) && seq.context.length === n ? (seq.context as unknown as Context[]) : []
    stack = stackWindows(windows, LANE_ROWS)
    stretches = context.length ? edgeStretches(context, plan!.overlap) : []
    edgeCount = stretches.reduce((sum, [a, b]) => sum + b - a, 0)
    number.value = String(index + 1)
    prev.disabled = index === 0
    next.disabled = index === sequences.length - 1
    root.dataset.sequence = String(index)
    root.dataset.positions = String(n)
    if (windows.length) root.dataset.windows = String(windows.length)
    else delete root.dataset.windows
    // Tracks in files: the canvas would hold the ruler alone, unless there are windows to show.
    body.hidden = !n || (!seq.tracks && !windows.length)
    toolbar.hidden = body.hidden
    hint.hidden = body.hidden
    sharedLabel.hidden = !seq.tracks
    hint.textContent = `Zoom with + and −, ctrl + wheel or a pinch; move with the scrollbar, a drag, or the arrow keys; hover for ${
      seq.tracks ? 'a position’s activation' : 'the windows that hold a position'
    }.`
    empty.hidden = !!n
    drawLabels()
    fitting = true
    start = 0
    hover = null
    draw()
  }

  zoomIn.addEventListener('click', () => zoomTo(ppp * 2))
  zoomOut.addEventListener('click', () => zoomTo(ppp / 2))
  fitButton.addEventListener('click', fit)
  sharedBox.addEventListener('change', draw)
  prev.addEventListener('click', () => show(index - 1))
  next.addEventListener('click', () => show(index + 1))
  number.addEventListener('change', () => show(Number(number.value) - 1 || 0))

  let pending = 0
  scroller.addEventListener('scroll', () => {
    const at = clamp(fromScroll(scroller.scrollLeft), 0, maxStart())
    if (Math.abs(at - start) * ppp < 0.25) return
    start = at
    pending ||= requestAnimationFrame(() => {
      pending = 0
      draw()
    })
  })
  scroller.addEventListener(
    'wheel',
    (event) => {
      if (!event.ctrlKey && !event.metaKey) return // a plain wheel scrolls: sideways here, up and down the page
      event.preventDefault()
      const box = scroller.getBoundingClientRect()
      zoomTo(ppp * Math.exp(-clamp(event.deltaY, -200, 200) * 0.005), event.clientX - box.left)
    },
    {passive: false},
  )
  scroller.addEventListener('keydown', (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey) return
    const page = visible()
    const moves: Record<string, () => void> = {
      '+': () => zoomTo(ppp * 2),
      '=': () => zoomTo(ppp * 2),
      '-': () => zoomTo(ppp / 2),
      _: () => zoomTo(ppp / 2),
      '0': fit,
      f: fit,
      ArrowLeft: () => moveTo(start - page / 8),
      ArrowRight: () => moveTo(start + page / 8),
      PageUp: () => moveTo(start - page * 0.9),
      PageDown: () => moveTo(start + page * 0.9),
      Home: () => moveTo(0),
      End: () => moveTo(n),
    }
    const move = moves[event.key]
    if (!move) return
    event.preventDefault()
    move()
  })

  const pointer = (event: PointerEvent) => {
    const box = overlay.getBoundingClientRect()
    hover = {x: event.clientX - box.left, y: event.clientY - box.top, clientX: event.clientX, clientY: event.clientY}
  }
  overlay.addEventListener('pointermove', (event) => {
    if (drag && event.buttons & 1) {
      const dx = event.clientX - drag.x
      if (Math.abs(dx) > 3) drag.moved = true
      if (drag.moved) scroller.scrollLeft = drag.scroll - dx
    }
    pointer(event)
    drawHover()
  })
  overlay.addEventListener('pointerdown', (event) => {
    pointer(event)
    if (event.button !== 0 || event.pointerType === 'touch') return drawHover() // a touch scrolls the scroller itself
    drag = {x: event.clientX, scroll: scroller.scrollLeft, moved: false}
    overlay.setPointerCapture(event.pointerId)
    drawHover()
  })
  const release = () => {
    const moved = drag?.moved
    drag = null
    if (moved) drawHover()
  }
  overlay.addEventListener('pointerup', release)
  overlay.addEventListener('pointercancel', release)
  overlay.addEventListener('pointerleave', () => {
    if (drag) return
    hover = null
    drawHover()
  })

  new ResizeObserver(() => {
    if (scroller.clientWidth !== width) draw()
  }).observe(scroller)
  drawers.set(root, draw)
  if (seq) show(0)
  return root
}
