/**
 * The arithmetic of the feature-track view (trackview.ts), with no DOM: which positions a pixel
 * column covers, the largest value over them, the ruler's step, and the zoom's bounds. Positions
 * here count from 0, as in the result's arrays; the view shows them counted from 1.
 */

/**
 * The canvas's rows, in CSS pixels: the ruler, the letters under it, then per track a band `track`
 * tall every `pitch` (the features in order, then the reconstruction error), and a margin at the bottom.
 * A sequence run in several windows gets a lane `windows` tall between the ruler and the letters: its
 * windows, stacked, over a strip `strip` tall marking the edge-affected positions.
 */
export const LAYOUT = {ruler: 20, letters: 18, track: 26, pitch: 30, bottom: 4, windows: 18, strip: 4} as const
/** Letters are drawn from this many CSS pixels per position on. */
export const LETTER_PX = 8
/** The most CSS pixels one position gets (or the whole sequence's fit, when that is more). */
export const MOST_PX = 32

/**
 * The positions pixel column `column` covers, `[from, to)`, when the first column starts at position
 * `start` (fractional) and each column spans `per` positions: from `floor(start + column * per)` to
 * the next column's first, but at least one position (zoomed in, several columns share one).
 * Within `[0, n)`; `from >= n` where the column lies past the end.
 */
export function columnRange(start: number, per: number, column: number, n: number): [number, number] {
  const from = Math.max(0, Math.floor(start + column * per))
  const to = Math.min(n, Math.max(from + 1, Math.floor(start + (column + 1) * per)))
  return [from, to]
}

/** Where the largest of `values[from..to)` is (the first, on a tie), and its value; `[-1, NaN]` for an empty range. */
export function argmaxIn(values: ArrayLike<number>, from: number, to: number): [number, number] {
  if (from >= to) return [-1, NaN]
  let at = from
  let best = values[from]!
  for (let p = from + 1; p < to; p++) {
    const v = values[p]!
    if (v > best) {
      best = v
      at = p
    }
  }
  return [at, best]
}

/** The ruler's step, in positions: the smallest of 1, 2, 5 × 10^k that is at least `span` (and at least 1). */
export function rulerStep(span: number): number {
  if (!(span > 1)) return 1
  const magnitude = 10 ** Math.floor(Math.log10(span))
  for (const m of [1, 2, 5, 10]) if (m * magnitude >= span - 1e-9) return m * magnitude
  return 10 * magnitude
}

/** The zoom's bounds, in CSS pixels per position: the whole sequence in `width` pixels, to `most` (or the fit, when larger). */
export function zoomBounds(width: number, n: number, most: number): [number, number] {
  const fit = width / Math.max(1, n)
  return [fit, Math.max(fit, most)]
}

/** `value` within `[lo, hi]`. */
export const clamp = (value: number, lo: number, hi: number) => Math.min(hi, Math.max(lo, value))

/**
 * One track's bars, per device-pixel column: how many pixels tall (of `tall`) each stands, the largest
 * value of the positions the column covers over `top` (a value at or below 0: none; above 0, at least
 * one pixel). Zoomed in (`per` < 1) with `gaps`, the last column of each position is left empty, so
 * that neighbouring bars stand apart.
 */
export function barHeights(values: ArrayLike<number>, start: number, per: number, columns: number, top: number, tall: number, gaps: boolean): Uint16Array {
  const n = values.length
  const out = new Uint16Array(columns)
  if (!(top > 0)) return out
  for (let c = 0; c < columns; c++) {
    const [from, to] = columnRange(start, per, c, n)
    if (from >= n) break
    if (gaps && per < 1 && Math.floor(start + (c + 1) * per) > from) continue
    const v = to - from === 1 ? values[from]! : argmaxIn(values, from, to)[1]
    if (v > 0) out[c] = Math.max(1, Math.round(Math.min(1, v / top) * tall))
  }
  return out
}

/** An image as 32-bit pixels, row by row (ImageData's buffer). */
export interface Pixels {
  data: Uint32Array
  width: number
  height: number
}

/** Set the pixels of `[x0, x1) × [y0, y1)` (clipped to the image) to `color`. */
export function fillPixels(image: Pixels, x0: number, y0: number, x1: number, y1: number, color: number): void {
  const left = Math.max(0, Math.floor(x0))
  const right = Math.min(image.width, Math.floor(x1))
  const bottom = Math.min(image.height, Math.floor(y1))
  if (left >= right) return
  for (let y = Math.max(0, Math.floor(y0)); y < bottom; y++) image.data.fill(color, y * image.width + left, y * image.width + right)
}

/** One position's context in a windowed result: the fewest tokens it had on its left and on its right. */
export type Context = readonly [number, number]
/** A window of a plan: positions `[start, end)`. */
export type Window = readonly [number, number]

/**
 * Which sides of position `p` (of `n`) are edge-affected: it had less than half the overlap of context
 * there (`2 × context < overlap`; with no overlap, none at all) while the sequence goes on past what it
 * saw. A position near the sequence's own end has less only because the sequence has no more: that is
 * no window's doing.
 */
export function edgeSides(context: Context, p: number, n: number, overlap: number): [boolean, boolean] {
  const least = Math.max(overlap, 1)
  return [2 * context[0] < least && context[0] < p, 2 * context[1] < least && context[1] < n - 1 - p]
}

/** The edge-affected stretches of a windowed sequence (`edgeSides`, either side), `[from, to)` in order. */
export function edgeStretches(context: ArrayLike<Context>, overlap: number): [number, number][] {
  const n = context.length
  const out: [number, number][] = []
  for (let p = 0; p < n; p++) {
    const [left, right] = edgeSides(context[p]!, p, n, overlap)
    if (!left && !right) continue
    const last = out.at(-1)
    if (last && last[1] === p) last[1] = p + 1
    else out.push([p, p + 1])
  }
  return out
}

/** The indices of the windows that hold position `p`, in order (the windows in order of their starts, as a plan has them). */
export function windowsAt(windows: readonly Window[], p: number): number[] {
  // The last window starting at or before p, then back while they still reach it: a plan has
  // thousands of windows, a position a few.
  let lo = 0
  let hi = windows.length
  while (lo < hi) {
    const mid = (lo + hi) >> 1
    if (windows[mid]![0] <= p) lo = mid + 1
    else hi = mid
  }
  const out: number[] = []
  for (let i = lo - 1; i >= 0 && windows[i]![1] > p; i--) out.unshift(i)
  return out
}

/**
 * A row for each window, so that windows that overlap sit in different rows and their overlap shows:
 * each takes the first row whose windows have all ended by its start. At most `most` rows: past them
 * (a plan whose overlap is more than half its window), the row that frees first, drawn over.
 */
export function stackWindows(windows: readonly Window[], most: number): {rows: number[]; count: number} {
  const ends: number[] = []
  const rows = windows.map(([start, end]) => {
    let row = ends.findIndex((e) => e <= start)
    if (row < 0 && ends.length < most) row = ends.length
    if (row < 0) row = ends.indexOf(Math.min(...ends))
    ends[row] = end
    return row
  })
  return {rows, count: ends.length}
}
