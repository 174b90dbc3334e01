/**
 * The feature-track view's arithmetic (src/dashboard/tracks.ts), in Node: which positions a pixel
 * column covers, the largest activation over them (so that a peak is never lost between pixels),
 * the bars' heights, the ruler's step and the pixels filled; for a windowed sequence, which windows
 * hold a position, their rows in the lane and the edge-affected stretches.
 */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {
  argmaxIn,
  barHeights,
  columnRange,
  edgeSides,
  edgeStretches,
  fillPixels,
  rulerStep,
  stackWindows,
  windowsAt,
  zoomBounds,
  type Context,
  type Window,
} from '../src/dashboard/tracks.ts'

/** Deterministic values in [-0.2, 1): a few negative, some exactly 0, as ReLU features and their neighbours give. */
function values(n: number, seed = 1): number[] {
  let x = seed
  return Array.from({length: n}, () => {
    x = (x * 1103515245 + 12345) % 2 ** 31
    const v = x / 2 ** 31 - 0.2
    return v < 0.1 ? Math.max(0, v) : v
  })
}

describe('pixel columns', () => {
  test('zoomed out, the columns tile the positions in view: each covered once, in order', () => {
    for (const [n, start, per, columns] of [
      [8000, 0, 8000 / 700, 700],
      [8000, 123.4, 7.3, 900],
      [10, 0, 10 / 3, 3],
      [1_000_003, 17.9, 1111.1, 800],
    ] as const) {
      let next = Math.floor(start)
      for (let c = 0; c < columns; c++) {
        const [from, to] = columnRange(start, per, c, n)
        if (from >= n) break
        assert.equal(from, next, `column ${c} of ${[n, start, per]}`)
        assert.ok(to > from)
        next = to
      }
      assert.equal(next, Math.min(n, Math.floor(start + columns * per)))
    }
  })

  test('zoomed in, each column covers the one position under it, and past the end nothing', () => {
    const per = 1 / 24 // 24 pixels per position
    for (let c = 0; c < 240; c++) assert.deepEqual(columnRange(5.5, per, c, 100), [Math.floor(5.5 + c / 24), Math.floor(5.5 + c / 24) + 1])
    assert.ok(columnRange(95, per, 24 * 6, 100)[0] >= 100)
  })

  test('argmaxIn: the first largest value of a range, and where', () => {
    assert.deepEqual(argmaxIn([0, 3, 1, 3, 2], 0, 5), [1, 3])
    assert.deepEqual(argmaxIn([0, 3, 1, 3, 2], 2, 5), [3, 3])
    assert.deepEqual(argmaxIn([-1, -2], 0, 2), [0, -1])
    assert.deepEqual(argmaxIn([1], 1, 1), [-1, NaN])
  })
})

describe('bar heights', () => {
  test('8,000 positions in 700 columns: each column stands for the largest value it covers', () => {
    const v = values(8000)
    const top = Math.max(...v)
    const per = 8000 / 700
    const heights = barHeights(v, 0, per, 700, top, 26, false)
    for (let c = 0; c < 700; c++) {
      const from = Math.floor(c * per)
      const to = Math.floor((c + 1) * per)
      const largest = Math.max(...v.slice(from, to))
      assert.equal(heights[c], largest > 0 ? Math.max(1, Math.round((largest / top) * 26)) : 0, `column ${c}`)
    }
    // A lone peak anywhere shows, full height, in the column that covers it.
    const flat = new Array<number>(8000).fill(0.01)
    flat[4321] = 5
    const peaked = barHeights(flat, 0, per, 700, 5, 26, false)
    assert.equal(peaked[Math.floor(4321 / per)], 26)
    assert.equal(peaked.filter((h) => h === 26).length, 1)
  })

  test('zoomed in, one bar per position, with a gap column between neighbours when asked', () => {
    const v = [0, 0.5, 1, 0.25]
    const heights = barHeights(v, 0, 1 / 4, 16, 1, 20, true)
    assert.deepEqual([...heights], [0, 0, 0, 0, 10, 10, 10, 0, 20, 20, 20, 0, 5, 5, 5, 0])
    assert.deepEqual([...barHeights(v, 0, 1 / 4, 16, 1, 20, false)], [0, 0, 0, 0, 10, 10, 10, 10, 20, 20, 20, 20, 5, 5, 5, 5])
  })

  test('nothing for values at or below 0, a scale of 0, or past the end; at least a pixel for the smallest above 0; above the scale, full height', () => {
    assert.deepEqual([...barHeights([0, -1, 1e-9, 3], 0, 1, 6, 1, 20, false)], [0, 0, 1, 20, 0, 0])
    assert.deepEqual([...barHeights([1, 2], 0, 1, 2, 0, 20, false)], [0, 0])
  })
})

describe('the ruler and the zoom', () => {
  test('the ruler steps by 1, 2 or 5 × 10^k, at least the span asked', () => {
    const cases: [number, number][] = [[0.3, 1], [1, 1], [1.2, 2], [3, 5], [7, 10], [10, 10], [11, 20], [914.3, 1000], [1001, 2000], [45_000, 50_000]]
    for (const [span, step] of cases) assert.equal(rulerStep(span), step, String(span))
  })

  test('zoom bounds: from the whole sequence in view to the most pixels a position gets', () => {
    assert.deepEqual(zoomBounds(800, 8000, 32), [0.1, 32])
    assert.deepEqual(zoomBounds(800, 10, 32), [80, 80]) // a short sequence fits at more than the most
  })
})

describe('pixels', () => {
  test('fillPixels fills the rectangle, clipped to the image', () => {
    const image = {data: new Uint32Array(4 * 3), width: 4, height: 3}
    fillPixels(image, 1, 1, 3, 5, 7)
    fillPixels(image, -2, 0, 1, 1, 9)
    assert.deepEqual([...image.data], [9, 0, 0, 0, 0, 7, 7, 0, 0, 7, 7, 0])
  })
})

/** A plan's windows over `n` positions, as the gateway cuts them (gateway/tools/windows.py, `plan`). */
function plan(n: number, window: number, overlap: number): Window[] {
  if (n <= window) return [[0, n]]
  const step = window - overlap
  const starts: number[] = []
  for (let s = 0; s < n - window; s += step) starts.push(s)
  starts.push(n - window)
  return starts.map((s) => [s, s + window])
}

/** Each position's least context on each side among the windows its value came from, as the gateway answers it (`context`). */
function contextOf(windows: Window[], stitch: 'center' | 'mean'): Context[] {
  const n = windows.at(-1)![1]
  const out: [number, number][] = Array.from({length: n}, () => [Infinity, Infinity])
  if (stitch === 'center') {
    // Each position from the window it is farthest inside: neighbours' overlaps split at their middle.
    const cuts = [0, ...windows.slice(1).map(([start], i) => Math.floor((start + windows[i]![1] + 1) / 2)), n]
    for (const [i, [start, end]] of windows.entries()) for (let p = cuts[i]!; p < cuts[i + 1]!; p++) out[p] = [p - start, end - 1 - p]
    return out
  }
  for (const [start, end] of windows) {
    for (let p = start; p < end; p++) out[p] = [Math.min(out[p]![0], p - start), Math.min(out[p]![1], end - 1 - p)]
  }
  return out
}

describe('windows and their edges', () => {
  test('the rule: less than half the overlap of context on a side where the sequence goes on', () => {
    // Position 500 of 1,000, overlap 100: 49 on its left is under half, 50 is not.
    assert.deepEqual(edgeSides([49, 300], 500, 1000, 100), [true, false])
    assert.deepEqual(edgeSides([50, 49], 500, 1000, 100), [false, true])
    assert.deepEqual(edgeSides([3, 2], 500, 1000, 5), [false, true]) // an odd overlap: half is 2.5
    // Windows that do not overlap: a position at a window's edge, with none on that side, is affected.
    assert.deepEqual(edgeSides([0, 40], 500, 1000, 0), [true, false])
    assert.deepEqual(edgeSides([1, 40], 500, 1000, 0), [false, false])
    // Near the sequence's own ends a position has all the sequence has: that is no window's doing.
    assert.deepEqual(edgeSides([0, 499], 0, 1000, 100), [false, false])
    assert.deepEqual(edgeSides([7, 40], 7, 1000, 100), [false, true])
    assert.deepEqual(edgeSides([400, 0], 999, 1000, 100), [false, false])
  })

  test('mean: every overlap of two windows is edge-affected; the last window’s wider one only at its two ends', () => {
    const windows = plan(8000, 2000, 400)
    assert.deepEqual(windows, [[0, 2000], [1600, 3600], [3200, 5200], [4800, 6800], [6000, 8000]])
    // The last window ends at the sequence's end: it overlaps the one before by 800, whose middle keeps 200 a side.
    assert.deepEqual(edgeStretches(contextOf(windows, 'mean'), 400), [[1600, 2000], [3200, 3600], [4800, 5200], [6000, 6200], [6600, 6800]])
  })

  test('center: with an even overlap no position inside has less than half of it; with an odd one, one position at each cut', () => {
    for (const [n, window, overlap] of [[8000, 2000, 400], [1000, 64, 16], [97, 10, 2]] as const) {
      assert.deepEqual(edgeStretches(contextOf(plan(n, window, overlap), 'center'), overlap), [], `${[n, window, overlap]}`)
    }
    // Windows [0, 10), [5, 15), [10, 20), [11, 21), cut at 8, 13 and 16: the position before each of the first two
    // cuts has 2 on its right, under 2.5; the last window overlaps its neighbour by 9, and keeps 4 a side.
    const windows = plan(21, 10, 5)
    assert.deepEqual(edgeStretches(contextOf(windows, 'center'), 5), [[7, 8], [12, 13]])
  })

  test('one window: nothing is edge-affected, though the ends have no context', () => {
    const context = contextOf(plan(300, 1000, 250), 'mean')
    assert.deepEqual(context[0], [0, 299])
    assert.deepEqual(edgeStretches(context, 250), [])
    assert.deepEqual(edgeStretches([], 250), [])
  })

  test('windowsAt: the windows that hold a position, in order', () => {
    for (const windows of [plan(8000, 2000, 400), plan(21, 10, 5), plan(50, 10, 0), plan(40, 10, 8), plan(5, 10, 2)]) {
      const n = windows.at(-1)![1]
      for (let p = 0; p < n; p++) {
        const expected = [...windows.keys()].filter((i) => windows[i]![0] <= p && p < windows[i]![1])
        assert.deepEqual(windowsAt(windows, p), expected, `position ${p} of ${windows.join(' ')}`)
      }
      assert.deepEqual(windowsAt(windows, n), [])
    }
  })

  test('stackWindows: overlapping windows in different rows, alternating where they can', () => {
    assert.deepEqual(stackWindows(plan(8000, 2000, 400), 3), {rows: [0, 1, 0, 1, 0], count: 2})
    assert.deepEqual(stackWindows(plan(50, 10, 0), 3), {rows: [0, 0, 0, 0, 0], count: 1}) // no overlap: one row
    // The last window, pinned to the end, overlaps the one two before it: a third row.
    assert.deepEqual(stackWindows(plan(21, 10, 5), 3), {rows: [0, 1, 0, 2], count: 3})
    assert.deepEqual(stackWindows([], 3), {rows: [], count: 0})
    // Within the rows allowed, no two windows of a row overlap; past them, the row that frees first.
    for (const windows of [plan(1000, 64, 16), plan(1000, 64, 31), plan(97, 10, 4)]) {
      const {rows, count} = stackWindows(windows, 3)
      assert.ok(count <= 3)
      for (let i = 1; i < windows.length; i++) {
        const before = rows.lastIndexOf(rows[i]!, i - 1)
        if (before >= 0) assert.ok(windows[before]![1] <= windows[i]![0], `windows ${before} and ${i} share row ${rows[i]}`)
      }
    }
    const deep = stackWindows(plan(40, 10, 8), 3) // five windows hold a position: three rows, reused in turn
    assert.equal(deep.count, 3)
    assert.deepEqual(deep.rows.slice(0, 6), [0, 1, 2, 0, 1, 2])
  })
})
