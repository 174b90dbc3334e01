/**
 * The dashboard's model picker in headless Chromium, against a gateway serving two models: the
 * tiny Llama (`base`, the default) and a tiny ESM-2 masked LM (`esm`). The picker lists both
 * with their kinds; picking one lists the tools as that model can run them (`GET /tools?model=`);
 * runs go to the model picked (the gateway's record of the job says so); the model picked
 * survives a reload as the tool does. Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Locator, type Page} from 'playwright-core'

import {EXAMPLES, listModels, runTool, type FillMaskResult, type ModelList, type PredictResult, type ToolInfo} from '../src/index.ts'
import type {JobSnapshot} from '../src/generated/types.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'
import {buildModel, ROOT, startGateway, tinyModel, type Gateway} from './support/gateway.ts'

let gateway: Gateway
let context: BrowserContext
let scratch: string
let models: ModelList
/** `GET /tools?model=NAME`, by model. */
const tools: Record<string, ToolInfo[]> = {}

/** A page at the dashboard with `hash`, once the gateway's own tool list (for `model`) is drawn. */
async function open(hash: string, model: string): Promise<Page & {errors: string[]}> {
  const page = (await context.newPage()) as Page & {errors: string[]}
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
  await page.goto(`${gateway.url}/${hash}`)
  await drawnFor(page, model)
  return page
}

/** Wait for the tool list of `model` from the gateway (not the copy kept from a visit before). */
const drawnFor = (page: Page, model: string) => page.waitForSelector(`#run[data-tools=gateway][data-model="${model}"] #form [data-field]`)

const runnable = (model: string) => tools[model]!.filter((t) => !t.unsupported).map((t) => t.name)

/** The gateway's record of the job a card shows. */
async function jobOf(card: Locator): Promise<JobSnapshot> {
  const id = await card.locator('.job-id').getAttribute('title')
  assert.match(id ?? '', /^[0-9a-f]{32}$/)
  return (await (await fetch(`${gateway.url}/jobs/${id}`)).json()) as JobSnapshot
}

describe('the dashboard on a gateway of two models', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-models-'))
    gateway = await startGateway(['--max-batch-size', '1'], {base: tinyModel(), esm: buildModel('esm_mlm', join(scratch, 'esm'))})
    models = await listModels(gateway.url)
    for (const model of models.models) tools[model.name] = (await (await fetch(`${gateway.url}/tools?model=${model.name}`)).json()) as ToolInfo[]
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('the picker lists both models with their kinds, the default picked; picking the masked LM lists the tools it can run', async () => {
    const page = await open('#predict', 'base')
    const picker = page.getByLabel('Model')
    assert.ok(await picker.isVisible())
    assert.equal(await picker.isEnabled(), true)
    assert.deepEqual(await page.locator('#model-select option').allInnerTexts(), ['base · causal_lm', 'esm · masked_lm'])
    assert.equal(await picker.inputValue(), 'base')
    // The default model's tools: predict, asked for by the URL, is picked.
    assert.deepEqual(await page.locator('#tool option').allInnerTexts(), runnable('base'))
    assert.equal(await page.locator('#tool').inputValue(), 'predict')
    assert.match(await page.locator('#model').innerText(), /^base · causal_lm · cpu/)
    assert.deepEqual(await page.locator('#unsupported summary code').allInnerTexts(), ['fill_mask', 'pseudo_loglikelihood'])
    // Every tool takes `model`: the picker sets it, no form has a field for it.
    assert.equal(await page.locator('#form [data-field=model]').count(), 0)

    await picker.selectOption('esm')
    await drawnFor(page, 'esm')
    assert.deepEqual(await page.locator('#tool option').allInnerTexts(), runnable('esm'))
    assert.ok(!runnable('esm').includes('predict'))
    // predict stays asked for, but the masked LM cannot run it: listed apart with the gateway's reason.
    assert.equal(await page.locator('#tool').inputValue(), runnable('esm')[0])
    const box = page.locator('#unsupported')
    assert.deepEqual(await box.locator('summary code').allInnerTexts(), tools.esm!.filter((t) => t.unsupported).map((t) => t.name))
    await box.locator('summary').click()
    const reason = box.locator('li[data-tool=predict]')
    await reason.waitFor({state: 'visible'})
    assert.equal(await reason.innerText(), models.models.find((m) => m.name === 'esm')!.unsupported!.predict)
    assert.match(await page.locator('#model').innerText(), /^esm · masked_lm · cpu/)
    assert.equal(new URL(page.url()).hash, `#${runnable('esm')[0]}&model=esm`)
    await page.screenshot({path: join(ARTIFACTS, 'model-picker.png'), fullPage: true})

    // Back to the default: predict, still asked for, is picked again.
    await picker.selectOption('base')
    await drawnFor(page, 'base')
    assert.equal(await page.locator('#tool').inputValue(), 'predict')
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('a run goes to the model picked: the job is that model’s, and its result is what a run with `model` gets', async () => {
    const page = await open('#fill_mask&model=esm', 'esm')
    assert.equal(await page.getByLabel('Model').inputValue(), 'esm')
    assert.equal(await page.locator('#tool').inputValue(), 'fill_mask')
    const job = await run(page)
    await finished(job)
    assert.equal(await job.locator('.job-model').innerText(), 'esm')
    assert.equal((await jobOf(job)).model, 'esm')
    assert.deepEqual(await rawResult<FillMaskResult>(job), await runTool(gateway.url, 'fill_mask', EXAMPLES.fill_mask, {model: 'esm'}))
    // The request shown is the one sent: `model` in the params' JSON.
    assert.match(await job.locator('.request pre').textContent() ?? '', /"model": "esm"/)

    // A tool both models run, on each in turn: each job is its own model's.
    await page.selectOption('#tool', 'embed')
    const onEsm = await run(page)
    await finished(onEsm)
    assert.equal((await jobOf(onEsm)).model, 'esm')
    await page.getByLabel('Model').selectOption('base')
    await drawnFor(page, 'base')
    assert.equal(await page.locator('#tool').inputValue(), 'embed')
    const onBase = await run(page)
    await finished(onBase)
    assert.equal((await jobOf(onBase)).model, 'base')
    assert.equal(await onBase.locator('.job-model').innerText(), 'base')
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('the model picked survives a reload, as the tool does; a model the gateway does not serve falls back to the default', async () => {
    const page = await open('#predict&model=base', 'base')
    await page.getByLabel('Model').selectOption('esm')
    await drawnFor(page, 'esm')
    await page.selectOption('#tool', 'pseudo_loglikelihood')
    await page.reload()
    await drawnFor(page, 'esm')
    assert.equal(await page.getByLabel('Model').inputValue(), 'esm')
    assert.equal(await page.locator('#tool').inputValue(), 'pseudo_loglikelihood')
    // No model in the URL: the one picked last here.
    await page.goto('about:blank') // a new document, not a change of hash
    await page.goto(`${gateway.url}/#embed`)
    await drawnFor(page, 'esm')
    assert.equal(await page.getByLabel('Model').inputValue(), 'esm')
    // A model that is not served (a link from a gateway restarted without it): the default.
    await page.goto('about:blank') // a new document, not a change of hash
    await page.goto(`${gateway.url}/#predict&model=gone`)
    await drawnFor(page, 'base')
    assert.equal(await page.getByLabel('Model').inputValue(), 'base')
    assert.equal(await page.locator('#tool').inputValue(), 'predict')
    const job = await run(page)
    await finished(job)
    assert.equal((await jobOf(job)).model, 'base')
    assert.equal((await rawResult<PredictResult>(job)).predictions.length, EXAMPLES.predict.top_k)
    await page.close()
  })
})


describe('the dashboard on a DNA model with tags', () => {
  let dna: Gateway
  let page: Page
  let browser: BrowserContext
  let profile: string

  before(async () => {
    // The loader is the test suite's own (tests/support/custom_model.py): the repository root is on the path.
    dna = await startGateway(['--model-loader', 'dna=tests.support.custom_model:load_dna'], {base: tinyModel()}, {PYTHONPATH: ROOT})
    profile = mkdtempSync(join(tmpdir(), 'streamgate-tags-'))
    browser = await launch(join(profile, 'profile'))
    page = await browser.newPage()
    await page.goto(`${dna.url}/#embed&model=dna`)
    await page.waitForSelector('#run[data-tools=gateway][data-model="dna"] #form [data-field]')
  })

  after(async () => {
    await browser?.close()
    await dna?.stop()
    if (profile) rmSync(profile, {recursive: true, force: true})
  })

  test('a model with tags gets a tag field listing them; a run with one is the run the API gives', async () => {
    const options = await page.locator('#form [data-field=tag] select option').allInnerTexts()
    assert.deepEqual(options.filter((o) => o !== '(none)'), ['bacteria', 'human'])
    await page.fill('[data-field=texts] textarea', 'acgtn')
    await page.selectOption('[data-field=tag] select', 'bacteria')
    const card = await run(page)
    await finished(card)
    const shown = await rawResult<Record<string, unknown>>(card)
    const direct = await runTool(dna.url, 'embed', {texts: ['acgtn'], tag: 'bacteria'}, {model: 'dna'})
    assert.deepEqual(shown, direct)
    // The model without tags: no tag field.
    await page.selectOption('#model-select', 'base')
    await page.waitForSelector('#run[data-tools=gateway][data-model="base"] #form [data-field]')
    assert.equal(await page.locator('#form [data-field=tag]').count(), 0)
  })
})
