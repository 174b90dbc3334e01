/**
 * `sae_annotate` over sequences as feature tracks, in headless Chromium, against a gateway on a tiny
 * Llama whose context holds 8,448 tokens (test/support/tiny_long_model.py, one token per letter) with
 * a tiny 16-feature SAE on layer 0 (test/support/tiny_sae.py). An 8,000-letter DNA sequence is drawn
 * as 16 tracks within a time budget stated against the sentence view, hovered, zoomed to its letters
 * and scrolled; several sequences get a stepper, and a sequence pasted with line breaks goes as typed.
 * Run in windows, it gets a lane of its windows and its edge-affected stretches shaded (one window:
 * neither), and the card's link downloads the result the stream brought. With its tracks as files
 * (bigWig), each sequence's features are listed with their files, its windows still drawn, and the
 * card links every file.
 * Screenshots go to test-artifacts/ (sae-tracks.png, sae-tracks-zoomed.png, sae-tracks-several.png,
 * sae-tracks-windows.png, sae-tracks-files.png).
 */
import assert from 'node:assert/strict'
import {execFileSync} from 'node:child_process'
import {mkdtempSync, readFileSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Locator, type Page} from 'playwright-core'

import {SAE_EXAMPLES, type AnnotateResult, type SequenceAnnotation} from '../src/index.ts'
import {fmt} from '../src/dashboard/dom.ts'
import {edgeStretches, LAYOUT, LETTER_PX, type Context} from '../src/dashboard/tracks.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'
import {ROOT, startGateway, WEB, type Gateway} from './support/gateway.ts'

const VENV = process.env.STREAMGATE_VENV ?? join(ROOT, '.venv')
const PYTHON = join(VENV, 'bin', 'python')

const LENGTH = 8000
const FEATURES = Array.from({length: 16}, (_, i) => i)
/** The sentence view's prompt: the SAE example's, 34 letters (35 tokens with <s>), so 35 × 16 chips and heatmap cells. */
const SENTENCE = SAE_EXAMPLES.sae_annotate.prompt!

/**
 * The track view's render time may be at most this many times the sentence view's, both measured the
 * same way (the job card's data-render-ms: from the result's arrival, parsed, to its view built, laid
 * out and drawn) side by side in one page, so a slow or busy machine slows both.
 *
 * Why 1: the sentence view's 35 tokens × 16 features are 560 feature chips and 560 heatmap cells of
 * DOM and SVG, which measured 80–110 ms here; the 8,000 × 16 tracks (128,000 activations, 228 times
 * as many) are pixels written straight into one canvas, which measured 9–20 ms: a ratio of 0.1–0.25.
 * A budget of 1 (the whole 8,000-letter sequence drawn no slower than one 35-token sentence) leaves
 * four times that for noise and slower machines, and still fails should the tracks fall back to a
 * DOM or SVG element per position (some 130,000 of them: seconds) or a draw per position and feature.
 */
const BUDGET = 1
/** Rounds of one sentence and one track run each, after one of each to warm up; the medians are compared. */
const ROUNDS = 5

/** `n` letters of ACGT, the same every run: stretches rich in GC, then in AT, in turn, every 500 letters. */
function dna(n: number, seed = 20240607): string {
  let x = seed
  let out = ''
  for (let i = 0; i < n; i++) {
    x = (x * 1103515245 + 12345) % 2 ** 31
    const r = x / 2 ** 31
    const gcRich = Math.floor(i / 500) % 2 === 0
    out += gcRich ? (r < 0.35 ? 'G' : r < 0.7 ? 'C' : r < 0.85 ? 'A' : 'T') : r < 0.35 ? 'A' : r < 0.7 ? 'T' : r < 0.85 ? 'G' : 'C'
  }
  return out
}

/** A sequence annotated in the result itself, not in files: its tokens and tracks are there. */
type Inline = SequenceAnnotation & {tokens: string[]; tracks: number[][]; relative_error: number[]}
function inline(s: SequenceAnnotation | undefined): Inline {
  if (!s) assert.fail('no sequences in the result')
  if (!s.tokens || !s.tracks || !s.relative_error) assert.fail(`a sequence without its tokens and tracks in the result: ${JSON.stringify(s).slice(0, 200)}`)
  return s as Inline
}

const median = (values: number[]) => {
  const sorted = [...values].sort((a, b) => a - b)
  const mid = Math.floor(sorted.length / 2)
  return sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

let gateway: Gateway
let context: BrowserContext
let scratch: string

async function open(): Promise<Page & {errors: string[]}> {
  const page = (await context.newPage()) as Page & {errors: string[]}
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
  await page.goto(`${gateway.url}/#sae_annotate`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')
  assert.equal(await page.locator('#tool').inputValue(), 'sae_annotate')
  return page
}

/** Run `sae_annotate` on `prompt` or on `sequence` (one box), picking features 0–15; the job's card once done. */
async function annotate(page: Page, input: {prompt: string} | {sequence: string}): Promise<Locator> {
  await page.selectOption('[data-field=mode] select', 'pick')
  await page.fill('[data-field=feature_ids] input', FEATURES.join(', '))
  await page.fill('[data-field=prompt] textarea', 'prompt' in input ? input.prompt : '')
  await page.fill('[data-field=sequences] textarea', 'sequence' in input ? input.sequence : '')
  const job = await run(page)
  await finished(job)
  return job
}

const renderMs = async (job: Locator) => Number(await job.locator('.result').getAttribute('data-render-ms'))
const dataset = (view: Locator) => view.evaluate((e) => ({...(e as HTMLElement).dataset}))

/** The tooltip's lines, parsed: the position (from 1), its letter, the feature and activation, and the pixel's range of positions. */
async function tip(page: Page): Promise<{position: number; letter: string; feature?: number; activation?: number; range?: [number, number]; text: string}> {
  const box = page.locator('#tip')
  await box.waitFor({state: 'visible'})
  const text = await box.innerText()
  const number = (s: string) => Number(s.replaceAll(',', ''))
  const head = /^position ([\d,]+) of ([\d,]+): (.+)$/m.exec(text) ?? assert.fail(`no position in the tip: ${text}`)
  const feature = /^#(\d+)(?: [^:]*)?: activation (\S+)$/m.exec(text)
  const range = /positions ([\d,]+)–([\d,]+)/.exec(text)
  return {
    position: number(head[1]!),
    letter: head[3]!,
    text,
    ...(feature ? {feature: Number(feature[1]), activation: Number(feature[2])} : {}),
    ...(range ? {range: [number(range[1]!), number(range[2]!)] as [number, number]} : {}),
  }
}

/** The y, in the canvas's CSS pixels, of the middle of track `row`. */
const trackY = (row: number) => LAYOUT.ruler + LAYOUT.letters + row * LAYOUT.pitch + LAYOUT.track / 2

/** Per track row, the canvas's bar pixels (the accent colour) and the tallest bar, in device pixels, near column `near[row]`. */
async function bars(view: Locator, rows: number, near: number[]): Promise<{count: number; tallest: number}[]> {
  return view.locator('canvas.track-canvas').evaluate(
    (canvas, {rows, near, layout}) => {
      const c = canvas as HTMLCanvasElement
      const probe = document.createElement('canvas').getContext('2d')!
      probe.fillStyle = getComputedStyle(c).getPropertyValue('--accent').trim()
      probe.fillRect(0, 0, 1, 1)
      const [r, g, b] = probe.getImageData(0, 0, 1, 1).data
      const ratio = c.width / c.clientWidth
      const out: {count: number; tallest: number}[] = []
      for (let row = 0; row < rows; row++) {
        const y0 = Math.round((layout.ruler + layout.letters + row * layout.pitch) * ratio)
        const tall = Math.round(layout.track * ratio)
        const data = c.getContext('2d')!.getImageData(0, y0, c.width, tall).data
        let count = 0
        let tallest = 0
        for (let x = Math.max(0, Math.round(near[row]! * ratio) - 2); x <= Math.min(c.width - 1, Math.round(near[row]! * ratio) + 2); x++) {
          let height = 0
          for (let y = 0; y < tall; y++) {
            const i = (y * c.width + x) * 4
            if (data[i] === r && data[i + 1] === g && data[i + 2] === b) height++
          }
          tallest = Math.max(tallest, height)
        }
        for (let i = 0; i < data.length; i += 4) if (data[i] === r && data[i + 1] === g && data[i + 2] === b) count++
        out.push({count, tallest: Math.round(tallest / ratio)})
      }
      return out
    },
    {rows, near, layout: LAYOUT},
  )
}

/** The y, in the canvas's CSS pixels, of the middle of track `row` below a windows lane. */
const laneTrackY = (row: number) => trackY(row) + LAYOUT.windows

/**
 * At each of the canvas's CSS columns `xs`: whether the windows lane has a window drawn there, whether
 * its strip is marked (the --warn colour), and how many track bands show their plain colour (--bg) in
 * their top pixel row, where only a bar's peak or a shade covers it.
 */
async function laneAt(view: Locator, xs: number[], rows: number): Promise<{window: boolean; strip: boolean; plain: number}[]> {
  return view.locator('canvas.track-canvas').evaluate(
    (canvas, {xs, rows, layout}) => {
      // No named functions in here: the test's compiler would wrap them in a helper the page lacks.
      const c = canvas as HTMLCanvasElement
      const probe = document.createElement('canvas').getContext('2d')!
      const [warn, band] = ['--warn', '--bg'].map((name) => {
        probe.fillStyle = getComputedStyle(c).getPropertyValue(name).trim()
        probe.fillRect(0, 0, 1, 1)
        return [...probe.getImageData(0, 0, 1, 1).data.slice(0, 3)].join()
      })
      const ratio = c.width / c.clientWidth
      const ctx = c.getContext('2d')!
      const laneTop = layout.ruler + 1
      const stripY = layout.ruler + layout.windows - layout.strip / 2 - 1
      const tracksTop = layout.ruler + layout.windows + layout.letters
      return xs.map((x) => {
        const column = ctx.getImageData(Math.round(x * ratio), 0, 1, c.height).data
        let window = false
        for (let y = laneTop; y < stripY - layout.strip / 2; y++) window ||= column[Math.round(y * ratio) * 4 + 3]! > 0
        const tops = Array.from({length: rows}, (_, r) => tracksTop + r * layout.pitch)
        const [strip, ...bands] = [stripY, ...tops].map((y) => [...column.slice(Math.round(y * ratio) * 4, Math.round(y * ratio) * 4 + 3)].join())
        return {window, strip: strip === warn, plain: bands.filter((rgb) => rgb === band).length}
      })
    },
    {xs, rows, layout: LAYOUT},
  )
}

describe('the SAE feature-track view', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-tracks-'))
    const model = join(scratch, 'model')
    execFileSync(PYTHON, [join(WEB, 'test', 'support', 'tiny_long_model.py'), model], {stdio: ['ignore', 'ignore', 'pipe']})
    const sae = execFileSync(PYTHON, [join(WEB, 'test', 'support', 'tiny_sae.py'), model, join(scratch, 'sae')], {encoding: 'utf8'}).trim()
    gateway = await startGateway(['--sae', sae], model)
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test(`8,000 positions × 16 features: the tracks drawn within ${BUDGET}× the sentence view's time`, async (t) => {
    const page = await open()
    const sequence = dna(LENGTH)
    const times: {sentence: number[]; tracks: number[]} = {sentence: [], tracks: []}
    for (let round = 0; round <= ROUNDS; round++) {
      for (const kind of round % 2 ? (['tracks', 'sentence'] as const) : (['sentence', 'tracks'] as const)) {
        const job = await annotate(page, kind === 'sentence' ? {prompt: SENTENCE} : {sequence})
        if (kind === 'sentence') assert.equal(await job.locator('.result .sae-token').count(), SENTENCE.length + 1) // <s> and a byte each
        else await job.locator('.result .sae-tracks[data-positions="8000"]').waitFor()
        if (round > 0) times[kind].push(await renderMs(job))
        // One card at a time: each is measured on the same page, not behind the cards before it.
        await job.locator('button[title=Remove]').click()
      }
    }
    const [sentence, tracks] = [median(times.sentence), median(times.tracks)]
    const ratio = tracks / sentence
    t.diagnostic(`sentence view (35 tokens × 16 features): ${times.sentence.map((ms) => ms.toFixed(1)).join(', ')} ms, median ${sentence.toFixed(1)}`)
    t.diagnostic(`track view (8,000 positions × 16 features): ${times.tracks.map((ms) => ms.toFixed(1)).join(', ')} ms, median ${tracks.toFixed(1)}`)
    t.diagnostic(`ratio ${ratio.toFixed(3)} (budget ${BUDGET})`)
    assert.ok(ratio <= BUDGET, `the track view took ${tracks.toFixed(1)} ms, ${ratio.toFixed(2)}× the sentence view's ${sentence.toFixed(1)} ms (budget ${BUDGET}×)`)

    // What is drawn: the sequence as the gateway read it, a labelled row per feature, bars where it is active.
    const job = await annotate(page, {sequence})
    const result = await rawResult<AnnotateResult>(job)
    const seq = inline(result.sequences?.[0])
    assert.equal(seq.tokens.join(''), sequence)
    assert.deepEqual(seq.features.map((f) => f.id), FEATURES)
    const view = job.locator('.result .sae-tracks')
    const labels = view.locator('.track-label[data-feature]')
    assert.deepEqual(await labels.evaluateAll((items) => items.map((l) => Number(l.getAttribute('data-feature')))), FEATURES)
    for (const [i, f] of seq.features.entries()) {
      assert.equal(await labels.nth(i).locator('.track-name').innerText(), f.label ? `#${f.id} ${f.label}` : `#${f.id}`)
      assert.equal(await labels.nth(i).locator('.track-max').innerText(), f.max > 0 ? `max ${fmt(f.max, 2)}` : 'never active')
    }
    const active = seq.features.filter((f) => f.max > 0)
    assert.ok(active.length >= 4, `only ${active.length} features fire on the sequence`)
    const shown = await dataset(view)
    assert.deepEqual([shown.first, shown.last, shown.letters], ['1', '8000', 'hidden'])
    const ppp = Number(shown.pxPerPosition)
    // Each active track has bars, and at its peak one full height (each track is scaled to its own max); the others none.
    const drawn = await bars(view, seq.features.length, seq.features.map((f) => (f.argmax + 0.5) * ppp))
    for (const [i, f] of seq.features.entries()) {
      if (f.max > 0) {
        assert.ok(drawn[i]!.count > 0, `#${f.id}: no bars`)
        assert.equal(drawn[i]!.tallest, LAYOUT.track, `#${f.id}: its peak at ${f.argmax} is not full height`)
      } else {
        assert.equal(drawn[i]!.count, 0, `#${f.id} never fires, yet has bars`)
      }
    }
    const label = (await view.locator('canvas.track-canvas').getAttribute('aria-label')) ?? ''
    assert.match(label, /16 features over 8,000 positions, 1 to 8,000 shown/)
    const strongest = [...active].sort((a, b) => b.max - a.max)[0]!
    assert.ok(label.includes(`peaks at ${fmt(strongest.max)} at position ${(strongest.argmax + 1).toLocaleString('en-US')}`), label)
    await job.scrollIntoViewIfNeeded()
    await page.screenshot({path: join(ARTIFACTS, 'sae-tracks.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('hover shows the position, letter and activation; zoomed in, the letters; it scrolls and drags', async () => {
    const page = await open()
    const sequence = dna(LENGTH)
    const job = await annotate(page, {sequence})
    const seq = inline((await rawResult<AnnotateResult>(job)).sequences?.[0])
    const view = job.locator('.result .sae-tracks')
    const overlay = view.locator('canvas.track-overlay')
    const row = seq.features.reduce((best, f, i) => (f.max > seq.features[best]!.max ? i : best), 0)
    const values = seq.tracks[row]!

    // Zoomed out: a pixel column covers several positions; the tip names the one with the largest activation there.
    await job.scrollIntoViewIfNeeded()
    let box = (await overlay.boundingBox())!
    const ppp = Number((await dataset(view)).pxPerPosition)
    assert.ok(ppp < 1, `the whole sequence fits at ${ppp} px per position`)
    const x = 200
    await page.mouse.move(box.x + x + 0.5, box.y + trackY(row))
    let seen = await tip(page)
    const p = seen.position - 1
    assert.equal(seen.letter, seq.tokens[p])
    assert.equal(seen.feature, seq.features[row]!.id)
    assert.ok(Math.abs(seen.activation! - values[p]!) < 5e-4, `${seen.activation} ≠ ${values[p]}`)
    const [from, to] = seen.range ?? assert.fail(`no range of positions in the tip: ${seen.text}`)
    assert.ok(from - 1 <= p && p < to, `${p + 1} not in ${from}–${to}`)
    assert.ok((from - 1) * ppp < x + 1 && to * ppp > x, `positions ${from}–${to} are not under pixel ${x}`)
    assert.ok(to - from + 1 >= Math.floor(1 / ppp), `${from}–${to}: fewer positions than a pixel covers`)
    assert.equal(values[p], Math.max(...values.slice(from - 1, to)))
    assert.equal((await dataset(view)).hoverPosition, String(seen.position))
    // The guide line is drawn on the overlay, at the pointer's column.
    const guide = await overlay.evaluate((c, x) => {
      const canvas = c as HTMLCanvasElement
      const ratio = canvas.width / canvas.clientWidth
      const data = canvas.getContext('2d')!.getImageData(Math.round((x - 1) * ratio), Math.round(30 * ratio), Math.round(3 * ratio), 1).data
      return data.some((v, i) => i % 4 === 3 && v > 0)
    }, x)
    assert.ok(guide, 'no guide line under the pointer')

    // Zoom in with + until the letters are drawn.
    await view.locator('.track-scroller').focus()
    for (let i = 0; i < 12 && (await dataset(view)).letters !== 'shown'; i++) await page.keyboard.press('+')
    let state = await dataset(view)
    assert.equal(state.letters, 'shown')
    assert.ok(Number(state.pxPerPosition) >= LETTER_PX)
    // ctrl + wheel zooms further about the pointer: the position under it stays under it.
    box = (await overlay.boundingBox())!
    await page.mouse.move(box.x + 300.5, box.y + trackY(row))
    const under = (await tip(page)).position
    await page.keyboard.down('Control')
    await page.mouse.wheel(0, -100)
    await page.keyboard.up('Control')
    await page.waitForFunction((before) => Number(document.querySelector<HTMLElement>('.sae-tracks')!.dataset.pxPerPosition) > before, Number(state.pxPerPosition))
    await page.mouse.move(box.x + 300.5, box.y + trackY(row) + 1)
    assert.ok(Math.abs((await tip(page)).position - under) <= 1, 'the zoom did not keep the position under the pointer')

    // Scroll: the arrow keys, the scroller itself, a drag; End shows the last position.
    state = await dataset(view)
    await view.locator('.track-scroller').focus()
    await page.keyboard.press('ArrowRight')
    const moved = await dataset(view)
    assert.ok(Number(moved.start) > Number(state.start), `ArrowRight: ${state.start} → ${moved.start}`)
    await view.locator('.track-scroller').evaluate((s) => (s.scrollLeft += 2400))
    await page.waitForFunction((before) => Number(document.querySelector<HTMLElement>('.sae-tracks')!.dataset.start) > before + 1, Number(moved.start))
    state = await dataset(view)
    await page.mouse.move(box.x + 400, box.y + trackY(row))
    await page.mouse.down()
    await page.mouse.move(box.x + 300, box.y + trackY(row), {steps: 5})
    await page.mouse.up()
    await page.waitForFunction((before) => Number(document.querySelector<HTMLElement>('.sae-tracks')!.dataset.start) > before, Number(state.start))
    const dragged = await dataset(view)
    const shift = (Number(dragged.start) - Number(state.start)) * Number(dragged.pxPerPosition)
    assert.ok(Math.abs(shift - 100) <= 2, `a 100 px drag moved ${shift} px`)

    // Zoomed in, the tip is exactly the position under the pointer: hover the middle of a chosen one's bar.
    const start = Number(dragged.start)
    const zoom = Number(dragged.pxPerPosition)
    const chosen = Math.ceil(start) + 7
    await page.mouse.move(box.x + (chosen - start + 0.5) * zoom, box.y + trackY(row))
    seen = await tip(page)
    assert.equal(seen.position, chosen + 1)
    assert.equal(seen.letter, seq.tokens[chosen])
    assert.ok(Math.abs(seen.activation! - values[chosen]!) < 5e-4, `${seen.activation} ≠ ${values[chosen]}`)
    assert.equal(seen.range, undefined)
    await page.screenshot({path: join(ARTIFACTS, 'sae-tracks-zoomed.png')}) // the viewport, with the tip and the guide line

    await view.locator('.track-scroller').focus()
    await page.keyboard.press('End')
    assert.equal((await dataset(view)).last, '8000')
    await view.locator('.track-fit').click()
    assert.deepEqual(await dataset(view).then((d) => [d.first, d.last, d.letters]), ['1', '8000', 'hidden'])
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('several sequences: one at a time, with a stepper; a sequence pasted with line breaks goes as typed', async () => {
    const page = await open()
    await page.fill('[data-field=prompt] textarea', '')
    await page.selectOption('[data-field=mode] select', 'top')
    await page.fill('[data-field=k] input', '4')
    const typed = ['>first\nACGTACGTAC\nGGTTAACC\n', 'TTTTGGGG CCCCAAAA']
    await page.fill('[data-field=sequences] textarea', typed[0]!)
    await page.click('[data-field=sequences] .block-add')
    await page.locator('[data-field=sequences] textarea').nth(1).fill(typed[1]!)
    const job = await run(page)
    await finished(job)
    const request = (await job.locator('.request pre').textContent()) ?? ''
    const sent = JSON.parse(request.slice(request.indexOf('\n') + 1)) as {sequences: string[]}
    assert.deepEqual(sent.sequences, typed, 'the sequences were not sent as typed')
    const result = await rawResult<AnnotateResult>(job)
    const sequences = (result.sequences ?? assert.fail('no sequences in the result')).map(inline)
    assert.deepEqual(
      sequences.map((s) => s.tokens.join('')),
      typed,
    ) // this model reads every byte: nothing was taken out on the way
    const view = job.locator('.result .sae-tracks')
    assert.match(await view.locator('.track-picker').innerText(), /of 2/)
    const ids = () => view.locator('.track-label[data-feature]').evaluateAll((items) => items.map((l) => Number(l.getAttribute('data-feature'))))
    for (const [i, s] of sequences.entries()) {
      if (i > 0) await view.locator('.track-next').click()
      const shown = await dataset(view)
      assert.equal(shown.sequence, String(i))
      assert.equal(shown.positions, String(s.tokens.length))
      assert.deepEqual(await ids(), s.features.map((f) => f.id))
      assert.ok(s.features.length <= 4)
    }
    assert.ok(await view.locator('.track-next').isDisabled())
    await view.locator('.track-index').fill('1')
    await view.locator('.track-index').dispatchEvent('change')
    assert.equal((await dataset(view)).sequence, '0')
    // Short sequences fit at more pixels per position than the letters need: drawn from the start.
    assert.equal((await dataset(view)).letters, 'shown')
    await job.scrollIntoViewIfNeeded()
    await page.screenshot({path: join(ARTIFACTS, 'sae-tracks-several.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })
  test('in windows: a lane of the windows, the edge-affected stretches shaded, a tip on each; one window: neither; the result downloads', async () => {
    const page = await open()
    await page.fill('[data-field=window] input', '2000')
    await page.fill('[data-field=overlap] input', '400')
    await page.selectOption('[data-field=stitch] select', 'mean')
    const job = await annotate(page, {sequence: dna(LENGTH)})
    const result = await rawResult<AnnotateResult>(job)
    const seq = result.sequences?.[0] ?? assert.fail('no sequences in the result')
    const plan = seq.plan ?? assert.fail('no plan in a windowed result')
    assert.deepEqual(plan.windows, [[0, 2000], [1600, 3600], [3200, 5200], [4800, 6800], [6000, 8000]])
    assert.deepEqual([plan.stitch, plan.window, plan.overlap], ['mean', 2000, 400])
    const context = seq.context as unknown as Context[]
    // Mean: each overlap is edge-affected; the last window's, 800 wide, only its 200 at each end.
    const stretches: [number, number][] = [[1600, 2000], [3200, 3600], [4800, 5200], [6000, 6200], [6600, 6800]]
    assert.deepEqual(edgeStretches(context, 400), stretches)

    const view = job.locator('.result .sae-tracks')
    const shown = await dataset(view)
    assert.equal(shown.windows, '5')
    const laneLabel = view.locator('.track-windows-label')
    assert.equal(await laneLabel.innerText(), 'windows')
    assert.match((await laneLabel.getAttribute('title')) ?? '', /5 windows of 2,000 positions overlapping by 400, stitched by mean/)
    const summary = await view.locator('.track-summary').innerText()
    assert.match(summary, /Run in 5 windows of 2,000 positions overlapping by 400, stitched by mean\./)
    assert.match(summary, /Shaded: 1,600 edge-affected positions in 5 stretches, with less than half the overlap \(200\) of context on a side where the sequence goes on\./)
    assert.match((await view.locator('canvas.track-canvas').getAttribute('aria-label')) ?? '', /Run in 5 windows .* Shaded: 1,600 edge-affected positions/)
    // The labels' column keeps each track's label beside its band, below the lane.
    const canvasTop = (await view.locator('canvas.track-canvas').boundingBox())!.y
    const firstLabel = (await view.locator('.track-label[data-feature]').first().boundingBox())!
    assert.ok(Math.abs(firstLabel.y + firstLabel.height / 2 - (canvasTop + laneTrackY(0) + (LAYOUT.pitch - LAYOUT.track) / 2)) <= 2, 'the labels are not beside their tracks')

    // Drawn: a window over every position; the strip and every band shaded over the stretches, and nowhere else.
    const ppp = Number(shown.pxPerPosition)
    const at = (p: number) => (p + 0.5) * ppp
    const inside = stretches.map(([a, b]) => at((a + b) / 2))
    const outside = [800, 2800, 4400, 6400, 7400].map(at)
    const rows = seq.features.length + 1
    for (const [i, seen] of (await laneAt(view, inside, rows)).entries()) {
      assert.deepEqual(seen, {window: true, strip: true, plain: 0}, `inside stretch ${stretches[i]}`)
    }
    for (const [i, seen] of (await laneAt(view, outside, rows)).entries()) {
      assert.ok(seen.window && !seen.strip && seen.plain > 0, `at ${outside[i]! / ppp}: ${JSON.stringify(seen)}`)
    }

    // The lane's tip: the windows that hold the position, its context, and whether it is edge-affected.
    await job.scrollIntoViewIfNeeded()
    const box = (await view.locator('canvas.track-overlay').boundingBox())!
    const laneY = box.y + LAYOUT.ruler + 5
    await page.mouse.move(box.x + at(1800), laneY)
    let seen = await tip(page)
    let p = seen.position - 1
    assert.ok(p >= 1600 && p < 2000, `position ${seen.position}`)
    assert.match(seen.text, /^window 1 of 5: positions 1–2,000$/m)
    assert.match(seen.text, /^window 2 of 5: positions 1,601–3,600$/m)
    assert.match(seen.text, new RegExp(`^context: ${context[p]![0].toLocaleString('en-US')} left, ${context[p]![1].toLocaleString('en-US')} right$`, 'm'))
    assert.match(seen.text, new RegExp(`^edge-affected: ${context[p]![0] < 200 ? 'left' : 'right'}, < 200 context$`, 'm'))
    await page.mouse.move(box.x + at(2800), laneY)
    seen = await tip(page)
    p = seen.position - 1
    assert.ok(p >= 2000 && p < 3200, `position ${seen.position}`)
    assert.match(seen.text, /^window 2 of 5: positions 1,601–3,600$/m)
    assert.doesNotMatch(seen.text, /window [13] |edge-affected/)
    // Over a track in a stretch, the tip says so too.
    await page.mouse.move(box.x + at(6100), box.y + laneTrackY(0))
    assert.match((await tip(page)).text, /^edge-affected: left, < 200 context$/m)
    await page.screenshot({path: join(ARTIFACTS, 'sae-tracks-windows.png')})

    // The card links the result as a file: the same JSON as the stream's data event.
    const jobId = (await job.locator('.job-id').getAttribute('title')) ?? assert.fail('no job id')
    const link = job.locator('a.download-result')
    assert.equal(await link.innerText(), 'Download result')
    assert.equal(await link.getAttribute('href'), `${gateway.url}/jobs/${jobId}/result`)
    assert.equal(await link.getAttribute('download'), `${jobId}.json`)
    const [download] = await Promise.all([page.waitForEvent('download'), link.click()])
    assert.equal(download.url(), `${gateway.url}/jobs/${jobId}/result`)
    assert.deepEqual(JSON.parse(readFileSync((await download.path())!, 'utf8')), result)
    await job.locator('button[title=Remove]').click()

    // A sequence no longer than the window is one window: a plan, but no lane and nothing shaded.
    const short = await annotate(page, {sequence: dna(1500)})
    const one = (await rawResult<AnnotateResult>(short)).sequences![0]!
    assert.deepEqual(one.plan?.windows, [[0, 1500]])
    assert.deepEqual(edgeStretches(one.context as unknown as Context[], one.plan!.overlap), [])
    const plain = short.locator('.result .sae-tracks')
    assert.equal((await dataset(plain)).windows, undefined)
    assert.equal(await plain.locator('.track-windows-label').count(), 0)
    assert.doesNotMatch(await plain.locator('.track-summary').innerText(), /window|Shaded/)
    const height = await plain.locator('canvas.track-canvas').evaluate((c) => (c as HTMLCanvasElement).clientHeight)
    assert.equal(height, LAYOUT.ruler + LAYOUT.letters + (one.features.length + 1) * LAYOUT.pitch + LAYOUT.bottom)
    assert.equal(await short.locator('a.download-result').getAttribute('href'), `${gateway.url}/jobs/${(await short.locator('.job-id').getAttribute('title'))!}/result`)
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('tracks as files: each sequence’s features summed up, each with its bigWig; its windows drawn; every file linked', async () => {
    const page = await open()
    await page.selectOption('[data-field=mode] select', 'pick')
    await page.fill('[data-field=feature_ids] input', FEATURES.join(', '))
    await page.fill('[data-field=prompt] textarea', '')
    await page.fill('[data-field=window] input', '1000')
    await page.fill('[data-field=overlap] input', '200')
    await page.selectOption('[data-field=file] select', 'bigwig')
    await page.fill('[data-field=names] textarea', 'first\nsecond')
    await page.fill('[data-field=sequences] textarea', dna(2400))
    await page.click('[data-field=sequences] .block-add')
    await page.locator('[data-field=sequences] textarea').nth(1).fill(dna(300, 7))
    const job = await run(page)
    await finished(job)
    const result = await rawResult<AnnotateResult>(job)
    const files = result.files ?? assert.fail('no files in the result')
    assert.deepEqual(files.map((f) => f.name).sort(), [...FEATURES.map((id) => `f${id}.bw`), 'features.bed', 'relative_error.bw'].sort())
    const sequences = result.sequences ?? assert.fail('no sequences in the result')
    assert.deepEqual(sequences.map((s) => [s.name, s.length, s.tokens, s.tracks]), [['first', 2400, undefined, undefined], ['second', 300, undefined, undefined]])
    const jobId = (await job.locator('.job-id').getAttribute('title')) ?? assert.fail('no job id')
    const fileUrl = (name: string) => `${gateway.url}/jobs/${jobId}/files/${name}`

    // The card lists every file by the result's own link, each with its format and size.
    const listed = job.locator('header .result-files li')
    assert.equal(await listed.count(), files.length)
    for (const [i, f] of files.entries()) {
      const link = listed.nth(i).locator('a.download-file')
      assert.equal(await link.innerText(), f.name)
      assert.equal(await link.getAttribute('href'), fileUrl(f.name))
      assert.equal(await link.getAttribute('download'), `${jobId}.${f.name}`)
      assert.match(await listed.nth(i).locator('.file-meta').innerText(), new RegExp(`^${f.format}, [\\d.]+ (B|KiB|MiB)$`))
    }

    // Windowed: the ruler and the windows lane, no track; the features in a table, each with its file.
    const view = job.locator('.result .sae-tracks')
    const [seq] = sequences
    const plan = seq!.plan ?? assert.fail('no plan in a windowed result')
    assert.ok(plan.windows.length > 1, JSON.stringify(plan))
    const shown = await dataset(view)
    assert.deepEqual([shown.sequence, shown.positions, shown.windows, shown.letters], ['0', '2400', String(plan.windows.length), 'hidden'])
    assert.equal(await view.locator('.track-label[data-feature]').count(), 0)
    assert.equal(await view.locator('canvas.track-canvas').evaluate((c) => (c as HTMLCanvasElement).clientHeight), LAYOUT.ruler + LAYOUT.windows + LAYOUT.bottom)
    const summary = await view.locator('.track-summary').innerText()
    assert.match(summary, new RegExp(`^first: 2,400 positions; 16 features, \\d+ active somewhere\\. Run in ${plan.windows.length} windows of 1,000 positions overlapping by 200`))
    assert.match(summary, /context is not in the result/)
    const rows = view.locator('.track-files table tbody tr')
    assert.deepEqual(await rows.evaluateAll((items) => items.map((r) => Number(r.getAttribute('data-feature')))), seq!.features.map((f) => f.id))
    for (const [i, f] of seq!.features.entries()) {
      const cells = await rows.nth(i).locator('td').allInnerTexts()
      assert.deepEqual(cells.slice(1, 4), f.max > 0 ? [fmt(f.max), fmt(f.mean), (f.argmax + 1).toLocaleString('en-US')] : ['never active', fmt(f.mean), '–'])
      assert.equal(await rows.nth(i).locator('a.download-file').getAttribute('href'), fileUrl(`f${f.id}.bw`))
    }
    assert.deepEqual(await view.locator('.track-files .file-list a.download-file').allInnerTexts(), files.map((f) => f.name).filter((name) => !/^f\d+\.bw$/.test(name)))
    assert.match(await view.locator('.track-files').innerText(), /IGV or JBrowse/)
    // The lane's tip: the position (no letter to show) and its windows.
    await job.scrollIntoViewIfNeeded()
    const box = (await view.locator('canvas.track-overlay').boundingBox())!
    await page.mouse.move(box.x + 5, box.y + LAYOUT.ruler + 5)
    const tipText = await page.locator('#tip').innerText()
    assert.match(tipText, /^position [\d,]+ of 2,400$/m)
    assert.match(tipText, /^window 1 of \d+: positions 1–1,000$/m)
    await page.screenshot({path: join(ARTIFACTS, 'sae-tracks-files.png'), fullPage: true})

    // One window: nothing to draw, the table alone.
    await view.locator('.track-next').click()
    assert.equal((await dataset(view)).sequence, '1')
    assert.ok(await view.locator('.track-body').isHidden())
    assert.ok(await view.locator('.track-toolbar').isHidden())
    assert.match(await view.locator('.track-summary').innerText(), /^second: 300 positions; 16 features/)
    assert.equal(await view.locator('.track-files table tbody tr').count(), sequences[1]!.features.length)

    // A file downloads whole: a bigWig, by its magic number.
    const bigwig = files.find((f) => f.name === 'relative_error.bw')!
    const [download] = await Promise.all([page.waitForEvent('download'), job.locator('header a.download-file[data-file="relative_error.bw"]').click()])
    assert.equal(download.url(), fileUrl(bigwig.name))
    const bytes = readFileSync((await download.path())!)
    assert.equal(bytes.length, bigwig.size)
    assert.equal(bytes.readUInt32LE(0), 0x888ffc26)
    assert.deepEqual(page.errors, [])
    await page.close()
  })
})
