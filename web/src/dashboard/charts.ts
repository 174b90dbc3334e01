/** Small hand-drawn charts: heatmap and line/scatter plots in SVG, bars in HTML, one shared tooltip. */
import {fmt, h, svg} from './dom.ts'

// -- colour ------------------------------------------------------------------

export type RGB = [number, number, number]
const hex = (s: string): RGB => [1, 3, 5].map((i) => parseInt(s.slice(i, i + 2), 16)) as RGB
const BLUES = ['#f7fbff', '#c6dbef', '#6baed6', '#2171b5', '#08306b'].map(hex)
const DIVERGING = ['#2166ac', '#92c5de', '#f7f7f7', '#f4a582', '#b2182b'].map(hex)

function ramp(stops: RGB[], t: number): RGB {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (stops.length - 1)
  const i = Math.min(stops.length - 2, Math.floor(x))
  const f = x - i
  const a = stops[i]!
  const b = stops[i + 1]!
  return [0, 1, 2].map((k) => Math.round(a[k]! + (b[k]! - a[k]!) * f)) as RGB
}

export const css = ([r, g, b]: RGB) => `rgb(${r},${g},${b})`

/** WCAG 2.x relative luminance of an sRGB colour (0–255 channels). */
export function luminance(rgb: RGB): number {
  const [r, g, b] = rgb.map((v) => {
    const c = v / 255
    return c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4
  }) as RGB
  return 0.2126 * r + 0.7152 * g + 0.0722 * b
}

/** WCAG 2.x contrast ratio of two colours, 1 to 21. */
export function contrast(a: RGB, b: RGB): number {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x) as [number, number]
  return (hi + 0.05) / (lo + 0.05)
}

const BLACK: RGB = [0, 0, 0]
const WHITE: RGB = [255, 255, 255]

/**
 * Text colour for a label on `fill`: black or white, whichever contrasts more. Pure black,
 * not a softer near-black: only with the extremes is the better of the two at least 4.58:1
 * (WCAG AA's 4.5 for normal text) on every fill, mid-greys and mid-blues included.
 */
export const ink = (fill: RGB): string => (contrast(fill, BLACK) >= contrast(fill, WHITE) ? '#000' : '#fff')

/** 0 → pale, 1 → dark blue. */
export const sequential = (t: number): RGB => ramp(BLUES, t)
/** -1 → blue, 0 → white, 1 → red. */
export const diverging = (t: number): RGB => ramp(DIVERGING, (t + 1) / 2)

export function legend(label: string, scale: (t: number) => RGB, from: number, to: number, low: string, high: string): HTMLElement {
  const stops = Array.from({length: 9}, (_, i) => css(scale(from + ((to - from) * i) / 8)))
  return h(
    'div',
    {class: 'legend'},
    h('span', {}, label),
    h('span', {}, low),
    h('span', {class: 'ramp', style: `background: linear-gradient(to right, ${stops.join(', ')})`}),
    h('span', {}, high),
  )
}

// -- tooltip -----------------------------------------------------------------

let tipBox: HTMLElement | undefined

/** The shared tooltip: `lines` (the first bold) near the pointer at `x`, `y` (client coordinates). */
export function showTip(lines: string[], x: number, y: number): void {
  tipBox ??= document.body.appendChild(h('div', {id: 'tip', role: 'tooltip'}))
  tipBox.replaceChildren(...lines.map((line, i) => h(i === 0 ? 'strong' : 'div', {}, line)))
  tipBox.hidden = false
  const {innerWidth, innerHeight} = window
  const box = tipBox.getBoundingClientRect()
  const left = Math.min(x + 14, innerWidth - box.width - 8)
  const top = y + 14 + box.height > innerHeight ? y - box.height - 10 : y + 14
  tipBox.style.left = `${Math.max(4, left)}px`
  tipBox.style.top = `${Math.max(4, top)}px`
}

export function hideTip(): void {
  if (tipBox) tipBox.hidden = true
}

/** Show `tip(target)`'s lines while the pointer is over an element that has a `data-tip` index. */
function withTips(element: Element, tip: (index: number) => string[]): void {
  const show = (event: Event) => {
    const pointer = event as PointerEvent
    const target = (pointer.target as Element | null)?.closest('[data-tip]')
    if (!target) return hideTip()
    showTip(tip(Number(target.getAttribute('data-tip'))), pointer.clientX, pointer.clientY)
  }
  element.addEventListener('pointermove', show)
  element.addEventListener('pointerdown', show)
  element.addEventListener('pointerleave', hideTip)
}

// -- heatmap -----------------------------------------------------------------

export interface HeatmapSpec {
  /** Row labels, top to bottom, and column labels, left to right. */
  rows: string[]
  cols: string[]
  /** The cell's colour, or null for no value. */
  fill: (row: number, col: number) => RGB | null
  /** Short text drawn in the cell. */
  text?: (row: number, col: number) => string
  tip: (row: number, col: number) => string[]
  rowTitle: string
  colTitle: string
}

export function heatmap(spec: HeatmapSpec): HTMLElement {
  const {rows, cols} = spec
  const rowLabel = (label: string) => (label.length > 18 ? `${label.slice(0, 17)}…` : label)
  const labelW = Math.min(150, Math.max(36, 12 + 7 * Math.max(...rows.map((r) => rowLabel(r).length))))
  const colLabel = (label: string) => (label.length > 8 ? `${label.slice(0, 7)}…` : label)
  const cellW = spec.text ? 62 : Math.min(62, Math.max(30, 10 + 7 * Math.max(...cols.map((c) => colLabel(c).length))))
  const cellH = 22
  const headH = 20
  const width = labelW + cols.length * cellW
  const height = headH + rows.length * cellH + 4
  const cells: SVGElement[] = []
  rows.forEach((_, r) =>
    cols.forEach((_, c) => {
      const color = spec.fill(r, c)
      const x = labelW + c * cellW
      const y = headH + r * cellH
      cells.push(
        svg('rect', {
          class: 'cell',
          x,
          y,
          width: cellW - 1,
          height: cellH - 1,
          fill: color ? css(color) : 'transparent',
          'data-tip': r * cols.length + c,
        }),
      )
      const text = spec.text?.(r, c)
      if (text && color) {
        const short = text.length > 8 ? `${text.slice(0, 7)}…` : text
        // A style, not the fill attribute: the stylesheet's `svg text` fill would win over an attribute.
        cells.push(svg('text', {x: x + cellW / 2, y: y + 15, style: `fill: ${ink(color)}`, 'text-anchor': 'middle', class: 'in-cell'}, short))
      }
    }),
  )
  const chart = svg(
    'svg',
    {class: 'heatmap', width, height, viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': `${spec.rowTitle} × ${spec.colTitle}`},
    cols.map((label, c) =>
      svg('text', {x: labelW + c * cellW + cellW / 2, y: 14, 'text-anchor': 'middle', class: 'axis'}, colLabel(label)),
    ),
    rows.map((label, r) => svg('text', {x: labelW - 6, y: headH + r * cellH + 15, 'text-anchor': 'end', class: 'axis'}, rowLabel(label))),
    cells,
  )
  withTips(chart, (i) => spec.tip(Math.floor(i / cols.length), i % cols.length))
  return h('div', {class: 'scroll'}, chart)
}

// -- line and scatter plots --------------------------------------------------

const W = 560
const H = 250
const M = {left: 52, right: 14, top: 12, bottom: 40}
const COLORS = ['#2171b5', '#d94801', '#238b45', '#6a51a3', '#cb181d', '#525252']

function ticks(lo: number, hi: number, count = 5): number[] {
  if (lo === hi) return [lo]
  const step0 = (hi - lo) / count
  const mag = 10 ** Math.floor(Math.log10(step0))
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0) ?? step0
  const out: number[] = []
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)))
  return out
}

function extent(values: number[], pad = 0.05): [number, number] {
  const finite = values.filter(Number.isFinite)
  if (finite.length === 0) return [0, 1]
  let lo = Math.min(...finite)
  let hi = Math.max(...finite)
  if (lo === hi) {
    lo -= Math.abs(lo) * 0.1 || 1
    hi += Math.abs(hi) * 0.1 || 1
  }
  const d = (hi - lo) * pad
  return [lo - d, hi + d]
}

interface Frame {
  sx: (x: number) => number
  sy: (y: number) => number
  axes: SVGElement[]
}

function frame(xDomain: [number, number], yDomain: [number, number], xLabel: string, yLabel: string, integerX: boolean): Frame {
  const [x0, x1] = xDomain
  const [y0, y1] = yDomain
  const sx = (x: number) => M.left + ((x - x0) / (x1 - x0 || 1)) * (W - M.left - M.right)
  const sy = (y: number) => H - M.bottom - ((y - y0) / (y1 - y0 || 1)) * (H - M.top - M.bottom)
  const xt = ticks(x0, x1).filter((t) => !integerX || Number.isInteger(t))
  const yt = ticks(y0, y1)
  const axes = [
    ...yt.map((t) => svg('line', {x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: 'grid'})),
    ...yt.map((t) => svg('text', {x: M.left - 6, y: sy(t) + 4, 'text-anchor': 'end', class: 'axis'}, fmt(t, 2))),
    ...xt.map((t) => svg('text', {x: sx(t), y: H - M.bottom + 16, 'text-anchor': 'middle', class: 'axis'}, fmt(t, 2))),
    svg('line', {x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: 'axis-line'}),
    svg('text', {x: (M.left + W - M.right) / 2, y: H - 6, 'text-anchor': 'middle', class: 'axis-title'}, xLabel),
    svg('text', {x: 12, y: (M.top + H - M.bottom) / 2, transform: `rotate(-90 12 ${(M.top + H - M.bottom) / 2})`, 'text-anchor': 'middle', class: 'axis-title'}, yLabel),
  ]
  return {sx, sy, axes}
}

export interface LineSpec {
  x: number[]
  series: {name: string; y: number[]}[]
  xLabel: string
  yLabel: string
  yDomain?: [number, number]
  tip: (series: number, point: number) => string[]
}

export function lineChart(spec: LineSpec): HTMLElement {
  const all = spec.series.flatMap((s) => s.y)
  const f = frame(extent(spec.x, 0.02), spec.yDomain ?? extent(all), spec.xLabel, spec.yLabel, true)
  const n = spec.x.length
  const marks = spec.series.flatMap((s, k) => {
    const color = COLORS[k % COLORS.length]!
    const points = s.y.map((y, i) => [f.sx(spec.x[i]!), f.sy(y)] as const)
    return [
      svg('polyline', {points: points.map(([x, y]) => `${x},${y}`).join(' '), fill: 'none', stroke: color, 'stroke-width': 2}),
      ...points.map(([x, y], i) => svg('circle', {cx: x, cy: y, r: 4, fill: color, class: 'point', 'data-tip': k * n + i})),
    ]
  })
  const chart = svg('svg', {class: 'plot line', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': `${spec.yLabel} by ${spec.xLabel}`}, f.axes, marks)
  withTips(chart, (i) => spec.tip(Math.floor(i / n), i % n))
  const key =
    spec.series.length > 1
      ? h('div', {class: 'key'}, spec.series.map((s, k) => h('span', {}, h('i', {style: `background:${COLORS[k % COLORS.length]}`}), s.name)))
      : null
  return h('div', {class: 'plot-box'}, chart, key)
}

export interface ScatterSpec {
  points: {x: number; y: number; label: string; group: number}[]
  xLabel: string
  yLabel: string
  tip: (point: number) => string[]
}

export function scatter(spec: ScatterSpec): HTMLElement {
  const f = frame(extent(spec.points.map((p) => p.x), 0.12), extent(spec.points.map((p) => p.y), 0.12), spec.xLabel, spec.yLabel, false)
  const marks = spec.points.flatMap((p, i) => {
    const color = COLORS[p.group % COLORS.length]!
    const [x, y] = [f.sx(p.x), f.sy(p.y)]
    return [
      svg('circle', {cx: x, cy: y, r: 5, fill: color, class: 'point', 'data-tip': i}),
      svg('text', {x: x + 7, y: y - 6, class: 'point-label'}, p.label.length > 18 ? `${p.label.slice(0, 17)}…` : p.label),
    ]
  })
  const chart = svg('svg', {class: 'plot scatter', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'embeddings, projected'}, f.axes, marks)
  withTips(chart, spec.tip)
  return h('div', {class: 'plot-box'}, chart)
}

// -- bars --------------------------------------------------------------------

export interface Bar {
  label: string
  value: number
  text: string
}

/** Horizontal bars, longest = `max` (default: the largest value). HTML, so it reflows on a phone. */
export function bars(items: Bar[], max?: number): HTMLElement {
  const top = max ?? Math.max(...items.map((b) => Math.abs(b.value)), 1e-12)
  return h(
    'div',
    {class: 'bars'},
    items.map((b) =>
      h(
        'div',
        {class: 'bar-row'},
        h('span', {class: 'bar-label', title: b.label}, b.label),
        h('span', {class: 'bar-track'}, h('span', {class: 'bar', style: `width:${Math.max(0.5, (Math.abs(b.value) / top) * 100)}%`})),
        h('span', {class: 'bar-value'}, b.text),
      ),
    ),
  )
}

export {css as rgb}
