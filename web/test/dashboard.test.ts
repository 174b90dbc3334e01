/**
 * The dashboard's pure parts, in Node: label colours against every colour the heatmaps and
 * chips can take, and JSON that keeps integers past 2^53 − 1 exact. (Node 20 has no source
 * text access in JSON.parse, so this runs the fallback that reads the raw text; the page
 * tests run Chromium's own.)
 */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {contrast, diverging, ink, sequential} from '../src/dashboard/charts.ts'
import {exactInteger, parseExact, stringifyExact} from '../src/dashboard/exact.ts'
import {contrastRatio} from './support/contrast.ts'

describe('label colours', () => {
  test('on every colour of both ramps, the label contrasts at least 4.5:1 (WCAG AA)', () => {
    const css = ([r, g, b]: number[]) => `rgb(${r}, ${g}, ${b})`
    for (let i = 0; i <= 1000; i++) {
      for (const [name, fill] of [
        ['sequential', sequential(i / 1000)],
        ['diverging', diverging(i / 500 - 1)],
      ] as const) {
        const label = ink(fill) === '#000' ? 'rgb(0, 0, 0)' : 'rgb(255, 255, 255)'
        const ratio = contrastRatio(css(fill), label)
        assert.ok(ratio >= 4.5, `${name}(${i / 1000}) = ${css(fill)} with ${label}: ${ratio.toFixed(2)}:1`)
        assert.ok(Math.abs(ratio - contrast(fill, ink(fill) === '#000' ? [0, 0, 0] : [255, 255, 255])) < 1e-9)
      }
    }
  })

  test('the better of black and white is picked', () => {
    assert.equal(ink([8, 48, 107]), '#fff') // the darkest blue
    assert.equal(ink([247, 251, 255]), '#000') // the palest
    assert.equal(ink([118, 118, 118]), '#000') // mid-grey: 4.62:1 with black, 4.54:1 with white
    assert.equal(contrast([0, 0, 0], [255, 255, 255]), 21)
  })
})

describe('exact JSON', () => {
  const text = '{"max":9223372036854775807,"min":-9223372036854775808,"safe":9007199254740991,"f":1.5,"e":1e300,"s":"9223372036854775807 in a string","list":[18446744073709551615,1]}'

  test('integers past 2^53 − 1 are read as bigints with every digit; the rest as JSON.parse reads them', () => {
    assert.deepEqual(parseExact(text), {
      max: 9223372036854775807n,
      min: -9223372036854775808n,
      safe: 9007199254740991,
      f: 1.5,
      e: 1e300,
      s: '9223372036854775807 in a string',
      list: [18446744073709551615n, 1],
    })
    assert.equal(parseExact('9007199254740992'), 9007199254740992n) // 2^53: a double holds it, but not every neighbour
    assert.deepEqual(parseExact('["a \\" 12345678901234567890", 12345678901234567890]'), ['a " 12345678901234567890', 12345678901234567890n])
  })

  test('bigints are written as their digits, and read back the same', () => {
    assert.equal(stringifyExact(parseExact(text)), text.replace('1e300', '1e+300'))
    assert.equal(stringifyExact({seed: 2n ** 64n, name: 'x'}, 2), '{\n  "seed": 18446744073709551616,\n  "name": "x"\n}')
    assert.equal(stringifyExact([-(2n ** 63n)]), '[-9223372036854775808]')
  })

  test('typed integers: plain digits exactly, a number while safe; anything else is not one', () => {
    assert.equal(exactInteger(' 42 '), 42)
    assert.equal(exactInteger('+7'), 7)
    assert.equal(exactInteger('9007199254740991'), 9007199254740991)
    assert.equal(exactInteger('9007199254740993'), 9007199254740993n)
    assert.equal(exactInteger('-9223372036854775808'), -9223372036854775808n)
    for (const other of ['1e20', '1.0', '', 'x', '0x10']) assert.equal(exactInteger(other), undefined, other)
  })
})
