/**
 * The dashboard's forms in headless Chromium, against a gateway on the tiny model (its tokenizer
 * without a chat template) with a test tool of 64-bit integer params (support/big_ints_tools.py):
 * integers past 2^53 − 1 shown and sent with every digit; the form drawn before `GET /tools`
 * answers (a skeleton on a first visit, the last tool's form after); chat refused by a model
 * with no chat template. Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Page} from 'playwright-core'

import {EXAMPLES, type ToolInfo} from '../src/index.ts'
import {parseExact} from '../src/dashboard/exact.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'
import {startGateway, tinyModelCopy, WEB, type Gateway} from './support/gateway.ts'

let gateway: Gateway
let context: BrowserContext
let scratch: string
let listed: string

type Watched = Page & {errors: string[]; runs: URL[]}

async function open(tool: string, into = context): Promise<Watched> {
  const page = (await into.newPage()) as Watched
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.runs = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && !/status of 4\d\d/.test(message.text()) && page.errors.push(message.text()))
  page.on('request', (request) => request.url().includes('/run?') && page.runs.push(new URL(request.url())))
  await page.goto(`${gateway.url}/#${tool}`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')
  assert.equal(await page.locator('#tool').inputValue(), tool)
  return page
}

/** Hold the page's `GET /tools` until `release` (then answer it with `answer`, or the gateway's own). */
async function holdTools(page: Page, answer?: (text: string) => string): Promise<{asked: Promise<void>; release: () => void}> {
  let release!: () => void
  const released = new Promise<void>((resolve) => (release = resolve))
  let asked!: () => void
  const seen = new Promise<void>((resolve) => (asked = resolve))
  await page.route('**/tools', async (route) => {
    asked()
    await released
    if (!answer) return route.continue()
    const response = await route.fetch()
    await route.fulfill({response, body: answer(await response.text())})
  })
  return {asked: seen, release}
}

const help = (page: Page, field: string) => page.locator(`[data-field=${field}] .help`).innerText()

describe('the dashboard’s forms', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-forms-'))
    const model = tinyModelCopy(join(scratch, 'plain'), false)
    gateway = await startGateway(['--tools', 'big_ints_tools', '--max-batch-size', '1'], model, {PYTHONPATH: join(WEB, 'test', 'support')})
    listed = await (await fetch(`${gateway.url}/tools`)).text()
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('bounds and defaults past 2^53 − 1 are shown with every digit, as the gateway wrote them', async () => {
    const tools = parseExact(listed) as ToolInfo[]
    const seed = (tools.find((t) => t.name === 'generate')!.params_schema as {properties: {seed: {anyOf: {maximum?: number | bigint}[]}}}).properties.seed
    const bound = seed.anyOf.find((a) => a.maximum !== undefined)!.maximum!
    assert.ok(listed.includes(`"maximum":${bound}`), `${bound} is not how /tools writes the bound`)
    const page = await open('generate')
    assert.match(await help(page, 'seed'), new RegExp(`(^| )≥ 0, ≤ ${bound}( |$)`))

    await page.selectOption('#tool', 'big_ints')
    await page.waitForSelector('[data-field=n]')
    assert.equal(await help(page, 'n'), 'Any 64-bit signed integer. · ≥ -9223372036854775808, ≤ 9223372036854775807; default 4611686018427387905')
    assert.equal(await page.locator('[data-field=n] input').inputValue(), '4611686018427387905')
    assert.match(await help(page, 'ids'), /≥ 0, ≤ 9223372036854775807/)
    await page.screenshot({path: join(ARTIFACTS, 'big-integers.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('an integer past 2^53 − 1 is sent exactly as typed, or refused in the form, never rounded', async () => {
    const page = await open('big_ints')
    // The default, as the form holds it.
    let job = await run(page)
    await finished(job)
    assert.deepEqual(await rawResult(job), {n: '4611686018427387905', ids: []})

    await page.fill('[data-field=n] input', '-9223372036854775808')
    await page.fill('[data-field=ids] input', '9223372036854775807, 9007199254740993, 7')
    job = await run(page)
    await finished(job)
    assert.deepEqual(await rawResult(job), {n: '-9223372036854775808', ids: ['9223372036854775807', '9007199254740993', '7']})
    assert.equal(page.runs.at(-1)!.searchParams.get('params'), '{"n":-9223372036854775808,"ids":[9223372036854775807,9007199254740993,7]}')

    // The JSON view shows the same digits, and what is written there is sent as written.
    await page.check('.json-toggle')
    const json = page.locator('.json-params')
    assert.deepEqual(JSON.parse((await json.inputValue()).replace(/(-?\d{16,})/g, '"$1"')), {n: '-9223372036854775808', ids: ['9223372036854775807', '9007199254740993', 7]})
    await json.fill('{"n": 9223372036854775807, "ids": [1234567890123456789]}')
    job = await run(page)
    await finished(job)
    assert.deepEqual(await rawResult(job), {n: '9223372036854775807', ids: ['1234567890123456789']})
    await page.uncheck('.json-toggle')
    assert.equal(await page.locator('[data-field=n] input').inputValue(), '9223372036854775807')

    // 1e20 is an integer too large to hold as typed: refused on its field, nothing sent.
    const jobs = await page.locator('article.job').count()
    const runs = page.runs.length
    await page.fill('[data-field=n] input', '1e20')
    await page.click('#run button[type=submit]')
    const field = page.locator('[data-field=n]')
    await field.locator('.field-error').waitFor()
    assert.equal(await field.locator('.field-error').innerText(), 'n: write 1e20 in plain digits, so that it is sent exactly')
    assert.match((await field.getAttribute('class')) ?? '', /invalid/)
    assert.equal(await page.locator('article.job').count(), jobs)
    assert.equal(page.runs.length, runs)

    // A seed past generate's bound goes as typed, and the gateway's refusal names the bound.
    await page.selectOption('#tool', 'generate')
    await page.fill('[data-field=seed] input', '9007199254740993')
    job = await run(page)
    await finished(job, 'error')
    assert.match(page.runs.at(-1)!.searchParams.get('params')!, /"seed":9007199254740993[,}]/)
    assert.equal(await job.locator('.error .code').innerText(), '422 invalid_params')
    assert.match(await page.locator('[data-field=seed] .field-error').innerText(), /^seed: .*9007199254740991/)
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('before /tools answers: a skeleton on a first visit, the last tool’s form on the next; what was typed stays', async () => {
    const fresh = await launch(join(scratch, 'first-visit'))
    try {
      // A first visit: nothing kept, so the page's own skeleton.
      let page = await fresh.newPage()
      let held = await holdTools(page)
      await page.goto(`${gateway.url}/`)
      await held.asked
      await page.screenshot({path: join(ARTIFACTS, 'loading-first-visit.png')})
      assert.equal(await page.locator('#run').getAttribute('data-tools'), 'loading')
      assert.ok(await page.locator('#form .skeleton').isVisible())
      assert.ok(await page.locator('#tool').isDisabled())
      assert.equal(await page.locator('#tool option').innerText(), 'loading tools…')
      assert.ok(await page.locator('#run button[type=submit]').isDisabled())
      assert.equal(await page.locator('#tools-state').innerText(), 'loading tools…')
      held.release()
      await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')
      assert.ok(await page.locator('#tools-state').isHidden())
      assert.ok(await page.locator('#run button[type=submit]').isEnabled())
      await page.selectOption('#tool', 'lens_grid')
      await page.waitForSelector('[data-field=stat]')
      await page.close()

      // The next visit: the last tool chosen, from the answer kept, while /tools is held.
      page = await fresh.newPage()
      held = await holdTools(page)
      await page.goto(`${gateway.url}/`)
      await held.asked
      await page.waitForSelector('#run[data-tools=saved] [data-field=prompt] textarea')
      assert.equal(await page.locator('#tool').inputValue(), 'lens_grid')
      assert.equal(await page.locator('[data-field=prompt] textarea').inputValue(), EXAMPLES.lens_grid.prompt)
      assert.ok(await page.locator('#run button[type=submit]').isEnabled())
      assert.equal(await page.locator('#form .skeleton').count(), 0)
      await page.screenshot({path: join(ARTIFACTS, 'loading-next-visit.png')})
      const prompt = page.locator('[data-field=prompt] textarea')
      await prompt.fill('typed before /tools answered')
      await prompt.evaluate((element) => ((element as HTMLElement).dataset.mark = 'kept'))
      held.release()
      await page.waitForSelector('#run[data-tools=gateway]', {state: 'attached'})
      // The schema is unchanged: the same form, with what was typed, and the focus, in it.
      assert.equal(await prompt.inputValue(), 'typed before /tools answered')
      assert.equal(await prompt.getAttribute('data-mark'), 'kept')
      assert.ok(await prompt.evaluate((element) => document.activeElement === element))
      await page.close()

      // A visit after the gateway changed the tool's params: its form is made again from the new schema.
      page = await fresh.newPage()
      held = await holdTools(page, (text) => text.replace('"title":"LensGridParams"', '"title":"LensGridParams","description":"changed"'))
      await page.goto(`${gateway.url}/`)
      await held.asked
      await page.waitForSelector('#run[data-tools=saved] [data-field=prompt] textarea')
      await page.fill('[data-field=prompt] textarea', 'typed for the old schema')
      held.release()
      await page.waitForSelector('#run[data-tools=gateway]', {state: 'attached'})
      assert.equal(await page.locator('[data-field=prompt] textarea').inputValue(), EXAMPLES.lens_grid.prompt)
      await page.close()
    } finally {
      await fresh.close()
    }
  })

  test('chat on a model without a chat template: its 422 shown in the conversation and on the job, the message kept', async () => {
    const page = await open('generate')
    await page.locator('.modes label', {hasText: 'Chat'}).click()
    assert.ok(await page.locator('#run button[type=submit]').isHidden())
    assert.ok(await page.locator('[data-field=prompts]').isHidden())
    assert.ok(await page.locator('[data-field=max_tokens]').isVisible())
    await page.fill('.chat-message', 'Hello there')
    await page.click('.chat-send')
    const job = page.locator('article.job').first()
    await finished(job, 'error')
    assert.equal(await job.locator('.error .code').innerText(), '422 unsupported_by_model')
    const message = await job.locator('.error .message').innerText()
    assert.match(message, /chat template/)
    const error = page.locator('.chat-error')
    await error.waitFor()
    assert.equal(await error.locator('.code').innerText(), '422 unsupported_by_model')
    assert.equal(await error.locator('.message').innerText(), message)
    assert.equal(await error.locator('.field-name').innerText(), '(messages)')
    assert.equal(await page.locator('.chat-log .bubble').count(), 0)
    assert.equal(await page.locator('.chat-message').inputValue(), 'Hello there')
    assert.ok(await page.locator('.chat-send').isEnabled())
    assert.deepEqual(JSON.parse(page.runs.at(-1)!.searchParams.get('params')!).messages, [{role: 'user', content: 'Hello there'}])
    await page.screenshot({path: join(ARTIFACTS, 'chat-unsupported.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })
})
