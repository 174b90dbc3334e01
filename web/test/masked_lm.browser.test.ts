/**
 * The dashboard in headless Chromium against a gateway serving a tiny ESM-2 masked LM
 * (tests/support/tiny_models.py): the tools it cannot run (generate and the other next-token tools)
 * are not offered but listed with the gateway's reasons; `fill_mask`, `pseudo_loglikelihood`
 * and `embed` (per token: one point per residue; written to a file: the file linked) run from the
 * page and draw their results; a page opened while the model loads lists the tools again once it is ready.
 * Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, readFileSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Page} from 'playwright-core'

import {EXAMPLES, runTool, type EmbedResult, type FillMaskResult, type PseudoLoglikelihoodResult, type ToolInfo} from '../src/index.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'
import {DRAWN} from './support/drawn.ts'
import {buildModel, startGateway, type Gateway} from './support/gateway.ts'

let gateway: Gateway
let context: BrowserContext
let scratch: string
let tools: ToolInfo[]

async function open(tool: string): Promise<Page & {errors: string[]}> {
  const page = (await context.newPage()) as Page & {errors: string[]}
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
  await page.goto(`${gateway.url}/#${tool}`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]') // drawn from the gateway's /tools, not the copy kept from a visit before
  return page
}


describe('the dashboard on a masked LM (ESM-2)', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-esm-'))
    gateway = await startGateway(['--max-batch-size', '1'], buildModel('esm_mlm', join(scratch, 'esm')))
    tools = (await (await fetch(`${gateway.url}/tools`)).json()) as ToolInfo[]
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('the tools it cannot run are not offered: listed apart, each with the gateway’s reason', async () => {
    const unsupported = tools.filter((t) => t.unsupported)
    assert.ok(unsupported.some((t) => t.name === 'generate'), 'generate runs on a masked LM?')
    // Asked for by the URL, generate is not there to pick: the first tool the model can run is.
    const page = await open('generate')
    const offered = await page.locator('#tool option').allInnerTexts()
    assert.deepEqual(offered, tools.filter((t) => !t.unsupported).map((t) => t.name))
    assert.ok(!offered.includes('generate'))
    assert.equal(await page.locator('#tool').inputValue(), offered[0])
    await page.locator('#model', {hasText: 'masked_lm'}).waitFor() // the model's kind, from /readyz
    const box = page.locator('#unsupported')
    assert.deepEqual(await box.locator('summary code').allInnerTexts(), unsupported.map((t) => t.name))
    await box.locator('summary').click()
    const reason = box.locator('li[data-tool=generate]')
    await reason.waitFor({state: 'visible'})
    assert.equal(await reason.innerText(), tools.find((t) => t.name === 'generate')!.unsupported)
    assert.match(await reason.innerText(), /^generate needs what the model .* \(masked_lm\) does not have: causal next-token logits/)
    await page.screenshot({path: join(ARTIFACTS, 'masked-lm-unsupported.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('opened while the model loads: every tool is offered, then the picker follows the model once it is ready', async () => {
    // As a gateway answers while its model loads: not ready, and no tool marked unsupported yet.
    const page = (await context.newPage()) as Page & {errors: string[]}
    let loading = true
    await page.route('**/readyz', (route) => (loading ? route.fulfill({status: 503, json: {ready: false, reason: 'loading the model'}}) : route.continue()))
    await page.route('**/tools', async (route) => {
      if (!loading) return route.continue()
      const listed = (await (await route.fetch()).json()) as ToolInfo[]
      await route.fulfill({json: listed.map((t) => ({...t, unsupported: null}))})
    })
    await page.goto(`${gateway.url}/#generate`)
    await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')
    assert.equal(await page.locator('#tool').inputValue(), 'generate')
    assert.equal(await page.locator('#tool option').count(), tools.length)
    assert.ok(await page.locator('#unsupported').isHidden())
    loading = false
    await page.locator('#model', {hasText: 'masked_lm'}).waitFor()
    await page.locator('#unsupported summary').waitFor()
    assert.deepEqual(await page.locator('#tool option').allInnerTexts(), tools.filter((t) => !t.unsupported).map((t) => t.name))
    assert.notEqual(await page.locator('#tool').inputValue(), 'generate')
    await page.close()
  })

  test('every tool it can run runs from the page with its example and draws its result', async () => {
    const page = await open('fill_mask')
    const runnable = tools.filter((t) => !t.unsupported).map((t) => t.name as keyof typeof DRAWN)
    for (const name of ['embed', 'fill_mask', 'pseudo_loglikelihood'] as const) assert.ok(runnable.includes(name), `${name} is not offered`)
    for (const tool of runnable) {
      await page.selectOption('#tool', tool)
      await page.waitForSelector('#form [data-field]')
      const job = await run(page)
      await finished(job)
      assert.equal(await job.getAttribute('data-tool'), tool)
      assert.ok((await job.locator(DRAWN[tool]).count()) > 0, `${tool}: nothing matches ${DRAWN[tool]}`)
    }
    await page.screenshot({path: join(ARTIFACTS, 'masked-lm-every-tool.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('fill_mask: each text with its masks filled by their top token, each mask’s top-k as bars', async () => {
    const page = await open('fill_mask')
    assert.equal(await page.locator('[data-field=texts] textarea').inputValue(), EXAMPLES.fill_mask.texts.join('\n'))
    const params = {texts: ['MKT<mask>YIAK', '<mask>KT<mask>'], top_k: 3}
    await page.fill('[data-field=texts] textarea', params.texts.join('\n'))
    await page.fill('[data-field=top_k] input', String(params.top_k))
    const job = await run(page)
    await finished(job)
    const direct = await runTool(gateway.url, 'fill_mask', params)
    assert.deepEqual(await rawResult<FillMaskResult>(job), direct)
    assert.equal(direct.mask_token, '<mask>')
    const texts = job.locator('.result .fill-text')
    assert.equal(await texts.count(), params.texts.length)
    for (const [i, fills] of direct.fills.entries()) {
      const text = texts.nth(i)
      assert.deepEqual(await text.locator('.mask-site').evaluateAll((sites) => sites.map((s) => Number(s.getAttribute('data-position')))), fills.map((f) => f.position))
      for (const [k, fill] of fills.entries()) {
        const rows = text.locator('.mask-site').nth(k).locator('.bar-row')
        assert.equal(await rows.count(), params.top_k)
        assert.equal(await rows.first().locator('.bar-label').innerText(), fill.predictions[0]!.text)
      }
      // The text as written, each mask showing its top token.
      const marks = await text.locator('mark.mask-fill').allInnerTexts()
      assert.deepEqual(marks, fills.map((f) => f.predictions[0]!.text))
      let k = 0
      assert.equal(await text.locator('.filled').innerText(), params.texts[i]!.replaceAll('<mask>', () => marks[k++]!))
    }
    assert.deepEqual(direct.fills.map((f) => f.map((m) => m.position)), [[3], [0, 3]])
    await job.scrollIntoViewIfNeeded()
    await page.screenshot({path: join(ARTIFACTS, 'fill-mask.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('pseudo_loglikelihood: a row per sequence, and each position’s log-probability as a line', async () => {
    const page = await open('pseudo_loglikelihood')
    const job = await run(page) // the example: two sequences, per position
    await finished(job)
    const result = await rawResult<PseudoLoglikelihoodResult>(job)
    const {sequences} = EXAMPLES.pseudo_loglikelihood
    assert.deepEqual(result.tokens_scored, sequences.map((s) => s.length)) // one token per residue
    const rows = job.locator('.result table.pll tbody tr')
    assert.equal(await rows.count(), sequences.length)
    for (const [i, sequence] of sequences.entries()) {
      const [shown, pll, scored, perToken] = await rows.nth(i).locator('td').allInnerTexts()
      assert.equal(shown, sequence)
      assert.ok(Math.abs(Number(pll) - result.pll[i]!) < 1e-3, `${pll} for ${result.pll[i]}`)
      assert.equal(scored, String(sequence.length))
      assert.ok(Math.abs(Number(perToken) - result.pll[i]! / sequence.length) < 1e-3, `${perToken} per token`)
    }
    const chart = job.locator('.result svg.plot.line')
    assert.equal(await chart.locator('polyline').count(), sequences.length)
    assert.equal(await chart.locator('circle.point').count(), sequences.reduce((n, s) => n + s.length, 0))
    // The second sequence's points are drawn over the first's.
    await chart.locator('circle.point').nth(sequences[0]!.length + 5).hover()
    const tip = page.locator('#tip')
    await tip.waitFor({state: 'visible'})
    assert.match(await tip.innerText(), new RegExp(`^${sequences[1]}, position 5 \\(${sequences[1]![5]}\\)\\nlog p = -?\\d`))
    await job.scrollIntoViewIfNeeded()
    await page.screenshot({path: join(ARTIFACTS, 'pseudo-loglikelihood.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('embed, pooling per_token: a point per residue, labelled with it, and no cosine table', async () => {
    const page = await open('embed')
    const texts = ['MKTAYIAKQR', 'GG']
    await page.fill('[data-field=texts] textarea', texts.join('\n'))
    await page.selectOption('[data-field=pooling] select', 'per_token')
    const job = await run(page)
    await finished(job)
    const result = await rawResult<EmbedResult>(job)
    assert.equal(result.pooling, 'per_token')
    assert.deepEqual(result.tokens, texts.map((t) => [...t]))
    const scatter = job.locator('.result svg.plot.scatter')
    assert.equal(await scatter.locator('circle.point').count(), 12)
    assert.deepEqual(await scatter.locator('text.point-label').allTextContents(), texts.flatMap((t) => [...t]))
    assert.equal(await job.locator('.result svg.heatmap').count(), 0)
    await scatter.locator('circle.point').last().hover() // drawn last, over any other
    const tip = page.locator('#tip')
    await tip.waitFor({state: 'visible'})
    assert.equal(await tip.innerText(), 'G\ntext 2: GG')
    await page.screenshot({path: join(ARTIFACTS, 'embed-per-token.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('embed, per_token as a file: what the vectors are, each text’s windows, and the file linked in place of a plot', async () => {
    const page = await open('embed')
    const texts = ['MKTAYIAKQRQISFVKSHFSRQ', 'GG']
    await page.fill('[data-field=texts] textarea', texts.join('\n'))
    await page.selectOption('[data-field=pooling] select', 'per_token')
    await page.selectOption('[data-field=file] select', 'safetensors')
    await page.fill('[data-field=window] input', '12')
    await page.fill('[data-field=overlap] input', '4')
    const job = await run(page)
    await finished(job)
    const result = await rawResult<EmbedResult>(job)
    assert.equal(result.embeddings, undefined)
    const [file] = result.files ?? assert.fail('no files in the result')
    assert.equal(file!.name, 'embeddings.safetensors')
    const plans = result.plans ?? assert.fail('no plans in a windowed result')
    const jobId = (await job.locator('.job-id').getAttribute('title')) ?? assert.fail('no job id')
    const url = `${gateway.url}/jobs/${jobId}/files/embeddings.safetensors`

    const view = job.locator('.result .embed-files')
    assert.match(await view.locator('p').first().innerText(), new RegExp(`^2 texts: a vector per token of ${result.dim} dimensions \\(layer ${result.layer}, per_token pooling\\), written to a file`))
    assert.equal(await job.locator('.result svg').count(), 0)
    const planned = await view.locator('.embed-plans li').allInnerTexts()
    assert.equal(planned.length, plans.length)
    assert.match(planned[0]!, new RegExp(`^text 1: ${plans[0]!.windows.length} windows of 12 positions overlapping by 4, stitched by \\w+$`))
    const link = view.locator('a.download-file')
    assert.equal(await link.innerText(), 'embeddings.safetensors')
    assert.equal(await link.getAttribute('href'), url)
    assert.equal(await job.locator('header .result-files a.download-file').getAttribute('href'), url)

    // What the link fetches is the file the result names: safetensors, with each text's vectors.
    const [download] = await Promise.all([page.waitForEvent('download'), link.click()])
    const bytes = readFileSync((await download.path())!)
    assert.equal(bytes.length, file!.size)
    const header = JSON.parse(bytes.subarray(8, 8 + Number(bytes.readBigUInt64LE(0))).toString('utf8')) as Record<string, {shape: number[]}>
    assert.deepEqual(header['embeddings.1']?.shape, [2, result.dim])
    await page.screenshot({path: join(ARTIFACTS, 'embed-files.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })
})
