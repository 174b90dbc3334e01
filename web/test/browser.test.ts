/**
 * The dashboard in headless Chromium (Debian's, driven by playwright-core; no browser is
 * downloaded) against a real gateway on the tiny model. Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync, writeFileSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Locator, type Page} from 'playwright-core'

import {EXAMPLES, type LogprobsResult, type ToolInfo} from '../src/index.ts'
import {ARTIFACTS, launch} from './support/browser.ts'
import {contrastRatio, luminance} from './support/contrast.ts'
import {DRAWN} from './support/drawn.ts'
import {startGateway, WEB, type Gateway} from './support/gateway.ts'
import {startProxy} from './support/proxy.ts'


let gateway: Gateway
let context: BrowserContext
let profile: string

/** A page at the dashboard, `width` pixels wide, with any page error failing the test. */
async function open(width = 1280, tool?: string, base = gateway.url): Promise<Page> {
  const page = await context.newPage()
  await page.setViewportSize({width, height: width < 600 ? 844 : 900})
  const errors: string[] = []
  page.on('pageerror', (error) => errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && !/status of 4\d\d/.test(message.text()) && errors.push(message.text()))
  ;(page as Page & {errors: string[]}).errors = errors
  await page.goto(`${base}/${tool ? `#${tool}` : ''}`)
  await page.waitForSelector('#run[data-tools=gateway]', {state: 'attached'}) // the gateway's /tools answered, not the copy kept from a visit before
  return page
}

function pageErrors(page: Page): string[] {
  return (page as Page & {errors: string[]}).errors
}

async function pick(page: Page, tool: string): Promise<void> {
  await page.selectOption('#tool', tool)
  await page.waitForSelector(`#form [data-field]`)
}

async function run(page: Page): Promise<ReturnType<Page['locator']>> {
  const before = await page.locator('article.job').count()
  await page.click('#run button[type=submit]')
  await page.waitForFunction((n) => document.querySelectorAll('article.job').length > n, before)
  return page.locator('article.job').first()
}

async function finished(job: ReturnType<Page['locator']>, state = 'done'): Promise<void> {
  await job.locator(`xpath=self::*[@data-state!="running"]`).waitFor({timeout: 60_000})
  const actual = await job.getAttribute('data-state')
  if (actual !== state) {
    const text = await job.innerText()
    assert.fail(`the job ended ${actual}, not ${state}:\n${text}`)
  }
}

async function shot(page: Page, name: string): Promise<void> {
  await page.screenshot({path: join(ARTIFACTS, `${name}.png`), fullPage: true})
}

describe('the dashboard', () => {
  before(async () => {
    // --retry-ms 100: a browser that reconnected after the end of a job would do it at once.
    // --max-batch-size 1: a job waits its turn rather than joining generate's running batch.
    // held_tools: a job that holds the worker until the test lets it go (the queue test).
    gateway = await startGateway(['--retry-ms', '100', '--max-batch-size', '1', '--log-level', 'info', '--tools', 'held_tools'], undefined, {
      PYTHONPATH: join(WEB, 'test', 'support'),
    })
    profile = mkdtempSync(join(tmpdir(), 'streamgate-chromium-'))
    context = await launch(profile)
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (profile) rmSync(profile, {recursive: true, force: true})
  })

  test('generate: the status timeline, tokens as they stream, the result; the stream is closed after it', async () => {
    const page = await open()
    await pick(page, 'generate')
    await page.fill('[data-field=prompts] textarea', 'Once upon a time')
    await page.fill('[data-field=max_tokens] input', '48')
    // Record the streamed text each time it grows, and whether the result was there yet.
    await page.evaluate(() => {
      const seen: {text: string; result: boolean}[] = []
      ;(window as unknown as {seen: typeof seen}).seen = seen
      new MutationObserver(() => {
        const job = document.querySelector('article.job')
        const text = job?.querySelector('.tokens .completion-text')?.textContent ?? ''
        if (text && text !== seen.at(-1)?.text) seen.push({text, result: !job?.querySelector('.result')?.hasAttribute('hidden')})
      }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true})
    })
    const job = await run(page)
    await finished(job)
    const steps = await job.locator('.timeline li').evaluateAll((items) => items.map((li) => li.getAttribute('data-status')))
    assert.deepEqual(steps, ['RECEIVED', 'QUEUED', 'RUNNING', 'done'])
    const seen = await page.evaluate(() => (window as unknown as {seen: {text: string; result: boolean}[]}).seen)
    const streamed = seen.filter((s) => !s.result)
    assert.ok(streamed.length >= 5, `the text grew only ${streamed.length} times before the result`)
    for (let i = 1; i < streamed.length; i++) assert.ok(streamed[i]!.text.startsWith(streamed[i - 1]!.text))
    const completion = await job.locator('.result .completion-text').innerText()
    assert.equal(completion.length > 0, true)
    assert.equal(streamed.at(-1)!.text, (JSON.parse(await job.locator('.raw pre').textContent() ?? '{}') as {completions: string[]}).completions[0])
    assert.match(await job.locator('.progress-text').innerText(), /48 \/ 48 tokens/)
    assert.equal(await job.locator('.badge').innerText(), 'done')
    await shot(page, 'generate')
    // No reconnect: the gateway saw exactly one request for this job, long after its retry delay.
    await page.waitForTimeout(600)
    const requests = gateway.output().match(/"GET \/generate\/run\?params=[^"]*Once/g) ?? []
    assert.equal(requests.length, 1, gateway.output())
    assert.deepEqual(pageErrors(page), [])
    // The header's link to the API's own page, served by the gateway.
    await page.click('a.docs')
    assert.match(await page.locator('h1').innerText(), /streamgate API/)
    assert.equal(await page.locator('h2#generate').count(), 1)
    await page.close()
  })

  test('logit_lens: a layer × position heatmap with the top tokens on hover', async () => {
    const page = await open()
    await pick(page, 'logit_lens')
    const job = await run(page)
    await finished(job)
    const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as {layers: number[]; positions: number[]}
    const cells = job.locator('svg.heatmap rect.cell')
    assert.equal(await cells.count(), result.layers.length * result.positions.length)
    assert.ok((await job.locator('svg.heatmap text.in-cell').count()) > 0)
    await cells.nth(3).hover()
    const tip = page.locator('#tip')
    await tip.waitFor({state: 'visible'})
    const lines = await tip.innerText()
    assert.match(lines, /^layer \d+, position \d+/)
    assert.match(lines, /^1\. .+%$/m)
    assert.match(lines, /^5\. .+%$/m)
    assert.match(lines, /entropy/)
    await shot(page, 'logit_lens')
    assert.deepEqual(pageErrors(page), [])
    await page.close()
  })

  test('heatmap labels: each contrasts with its cell at least 4.5:1 (WCAG AA), in light and dark mode', async () => {
    for (const colorScheme of ['light', 'dark'] as const) {
      const page = await open()
      await page.emulateMedia({colorScheme})
      const cells: {fill: string; ink: string; label: string; where: string}[] = []
      /** The fill of each labelled cell (the rect drawn just before its label) and the label's colour, as computed. */
      const read = async (job: Locator, where: string) => {
        const found = await job.locator('.result svg.heatmap text.in-cell').evaluateAll((texts) =>
          texts.map((text) => ({fill: getComputedStyle(text.previousElementSibling!).fill, ink: getComputedStyle(text).fill, label: text.textContent ?? ''})),
        )
        assert.ok(found.length > 0, `${where}: no labelled cell`)
        cells.push(...found.map((cell) => ({...cell, where})))
      }
      // The logit lens coloured by top-1 probability (low on the tiny random model: pale cells), then
      // by entropy (near its maximum everywhere: the darkest cells).
      await pick(page, 'logit_lens')
      let job = await run(page)
      await finished(job)
      await read(job, 'logit_lens by top-1 probability')
      await job.locator('.result .lens select').selectOption({label: 'entropy'})
      await read(job, 'logit_lens by entropy')
      // lens_grid by rank: rank 1 darkest, and a random model's ranks spread over the ramp.
      await pick(page, 'lens_grid')
      await page.selectOption('[data-field=stat] select', 'rank')
      job = await run(page)
      await finished(job)
      await read(job, 'lens_grid by rank')
      // embed's cosine table: its colours stretched over the range the pairs span.
      await pick(page, 'embed')
      job = await run(page)
      await finished(job)
      await read(job, 'embed cosines')
      for (const cell of cells) {
        const ratio = contrastRatio(cell.fill, cell.ink)
        assert.ok(ratio >= 4.5, `${colorScheme}, ${cell.where}: "${cell.label}" in ${cell.ink} on ${cell.fill} is ${ratio.toFixed(2)}:1`)
      }
      const fills = cells.map((cell) => luminance(cell.fill))
      assert.ok(Math.min(...fills) < 0.05 && Math.max(...fills) > 0.8, `the cells span only luminances ${Math.min(...fills)} to ${Math.max(...fills)}`)
      await shot(page, `heatmap-labels-${colorScheme}`)
      assert.deepEqual(pageErrors(page), [])
      await page.close()
    }
  })

  test('an invalid field: the 422 shown with its code and message, on the field', async () => {
    const page = await open()
    await pick(page, 'generate')
    await page.fill('[data-field=max_tokens] input', '0')
    const job = await run(page)
    await finished(job, 'error')
    assert.equal(await job.locator('.error .code').innerText(), '422 invalid_params')
    assert.equal(await job.locator('.error .message').innerText(), 'max_tokens: expected `int` >= 1')
    const field = page.locator('[data-field=max_tokens]')
    assert.match((await field.getAttribute('class')) ?? '', /invalid/)
    assert.equal(await field.locator('.field-error').innerText(), 'max_tokens: expected `int` >= 1')
    await shot(page, 'invalid-field')
    await page.close()
  })

  test('every built-in tool the model can run runs from the page and draws its result; the others are listed apart', async () => {
    const page = await open()
    const tools = (await (await fetch(`${gateway.url}/tools`)).json()) as ToolInfo[]
    const runnable = tools.filter((t) => !t.unsupported).map((t) => t.name)
    // The tiny Llama is a causal LM: the masked-LM tools are the ones it cannot run.
    assert.deepEqual(tools.filter((t) => t.unsupported).map((t) => t.name), ['fill_mask', 'pseudo_loglikelihood'])
    assert.deepEqual(await page.locator('#tool option').allInnerTexts(), runnable)
    assert.deepEqual(await page.locator('#unsupported summary code').allInnerTexts(), ['fill_mask', 'pseudo_loglikelihood'])
    // One model served: no model picker, and no form has a field for the `model` every tool takes.
    assert.ok(await page.locator('#model-picker').isHidden())
    assert.equal(await page.locator('#form [data-field=model]').count(), 0)
    const shown = runnable.filter((t) => t !== 'held') // the queue test's tool, which waits for its gate
    for (const tool of shown) {
      const selector = DRAWN[tool as keyof typeof DRAWN]
      await pick(page, tool)
      const job = await run(page)
      await finished(job)
      assert.equal(await job.getAttribute('data-tool'), tool)
      assert.ok((await job.locator(selector).count()) > 0, `${tool}: nothing matches ${selector}`)
    }
    assert.equal(await page.locator('article.job[data-state=done]').count(), shown.length)
    // … and the runs name no model: the gateway's only one runs them.
    assert.equal(await page.locator('article.job .job-model').count(), 0)
    assert.equal(await page.locator('article.job[data-tool=predict] .result .bar-row').count(), EXAMPLES.predict.top_k)
    await shot(page, 'every-tool')
    assert.deepEqual(pageErrors(page), [])
    await page.close()
  })

  test('logprobs into a TSV file: each text\u2019s length and the file linked in place of the tokens; the file a line a token', async () => {
    const page = await open()
    await pick(page, 'logprobs')
    await page.fill('[data-field=prompts] textarea', 'The capital of France is Paris\nA second text')
    await page.fill('[data-field=top] input', '0') // a TSV line holds one score: the top tokens need jsonl
    await page.selectOption('[data-field=file] select', 'tsv')
    const job = await run(page)
    await finished(job)
    const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as LogprobsResult
    const [file] = result.files ?? assert.fail('no files in the result')
    assert.equal(file!.name, 'logprobs.tsv')
    const view = job.locator('.result .logprobs-files')
    const texts = await view.locator('.logprobs-texts li').allInnerTexts()
    assert.deepEqual(texts.map((t) => t.split(';')[0]), result.sequences.map((seq, i) => `text ${i + 1}: ${seq.length} tokens`))
    assert.ok(texts.every((t) => t.includes('; greedy next token ')), 'the example asks for the next token')
    const link = view.locator('a.download-file')
    assert.equal(await link.innerText(), 'logprobs.tsv')
    const jobId = (await job.locator('.job-id').getAttribute('title')) ?? assert.fail('no job id')
    const body = await (await fetch(`${gateway.url}/jobs/${jobId}/files/logprobs.tsv`)).text()
    const lines = body.trimEnd().split('\n')
    assert.equal(lines[0], 'sequence\tposition\ttoken_id\ttoken\tlogprob')
    assert.equal(lines.length - 1, result.sequences.reduce((n, seq) => n + (seq.length ?? 0), 0))
    assert.deepEqual(pageErrors(page), [])
    await page.close()
  })

  test('several jobs at once: each streams on its own, queued behind the others', async () => {
    const page = await open()
    // A held job takes the model's one worker (a batch of one) until its gate file exists; two
    // generate jobs sent meanwhile wait behind it, #1 and #2, for as long as the gate stays shut.
    const gate = join(profile, 'gate')
    await pick(page, 'held')
    await page.fill('[data-field=gate] input', gate)
    const holder = await run(page)
    await holder.locator('.timeline li[data-status=RUNNING]').waitFor()
    await pick(page, 'generate')
    await page.fill('[data-field=max_tokens] input', '24')
    for (let i = 0; i < 2; i++) await run(page)
    const jobs = page.locator('article.job') // newest first
    await jobs.nth(0).locator('.timeline li[data-status=QUEUED]', {hasText: '#2'}).waitFor()
    assert.match(await jobs.nth(1).locator('.timeline li[data-status=QUEUED]').innerText(), /#1/)
    writeFileSync(gate, '')
    for (let i = 0; i < 3; i++) await finished(jobs.nth(i))
    // Each generate job streamed its own tokens into its own card.
    for (let i = 0; i < 2; i++) {
      const result = JSON.parse((await jobs.nth(i).locator('.raw pre').textContent()) ?? '{}') as {completions: string[]}
      assert.equal(await jobs.nth(i).locator('.tokens .completion-text').textContent(), result.completions[0])
    }
    await shot(page, 'several-jobs')
    await page.close()
  })

  test('a dropped connection: the browser reconnects and the same job resumes', async () => {
    const proxy = await startProxy(gateway.url)
    try {
      const page = await open(1280, 'generate', proxy.url)
      await pick(page, 'generate')
      await page.fill('[data-field=prompts] textarea', 'It was a dark and stormy night')
      await page.fill('[data-field=max_tokens] input', '160')
      const job = await run(page)
      await job.locator('.token').nth(4).waitFor({state: 'attached'}) // a token may have no text of its own
      proxy.drop()
      await finished(job)
      const steps = await job.locator('.timeline li').evaluateAll((items) => items.map((li) => li.getAttribute('data-status')))
      assert.deepEqual(steps, ['RECEIVED', 'QUEUED', 'RUNNING', 'reconnecting', 'resumed', 'done'])
      // Every token once, in order: the stream went on from the last event it had.
      const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as {completions: string[]}
      assert.equal(await job.locator('.tokens .completion-text').textContent(), result.completions[0])
      await shot(page, 'reconnected')
      await page.close()
    } finally {
      await proxy.close()
    }
  })

  test('cancel: the job is deleted and ends with its cancelled event', async () => {
    const page = await open()
    // A held job whose gate never opens: it runs until cancelled, however fast the machine.
    await pick(page, 'held')
    await page.fill('[data-field=gate] input', join(profile, 'never'))
    const job = await run(page)
    await job.locator('.timeline li[data-status=RUNNING]').waitFor()
    await job.locator('button', {hasText: 'Cancel'}).click()
    await finished(job, 'cancelled')
    assert.equal(await job.locator('.error .code').innerText(), 'cancelled')
    assert.deepEqual(await job.locator('.timeline li').evaluateAll((items) => items.map((li) => li.getAttribute('data-status'))), [
      'RECEIVED',
      'QUEUED',
      'RUNNING',
      'error',
    ])
    for (let i = 0; ; i++) {
      const ready = (await (await fetch(`${gateway.url}/readyz`)).json()) as {running: number}
      if (ready.running === 0) break
      assert.ok(i < 100, 'the job still runs')
      await page.waitForTimeout(50)
    }
    await page.close()
  })

  test('on a phone-width screen: no sideways scrolling, the heatmap scrolls in its box', async () => {
    const page = await open(390, 'logit_lens')
    assert.equal(await page.locator('#tool').inputValue(), 'logit_lens')
    const job = await run(page)
    await finished(job)
    const [scrollWidth, clientWidth] = await page.evaluate(() => [document.documentElement.scrollWidth, document.documentElement.clientWidth])
    assert.ok(scrollWidth <= clientWidth, `the page is ${scrollWidth}px wide on a ${clientWidth}px screen`)
    await shot(page, 'phone')
    assert.deepEqual(pageErrors(page), [])
    await page.close()
  })
})
