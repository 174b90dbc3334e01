/**
 * The feature-track view's arithmetic (src/dashboard/tracks.ts), in Node: which positions a pixel
 * column covers, the largest activation over them (so that a peak is never lost between pixels),
 * the bars' heights, the ruler's step and the pixels filled.
 */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {argmaxIn, barHeights, columnRange, fillPixels, rulerStep, zoomBounds} from '../src/dashboard/tracks.ts'

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
