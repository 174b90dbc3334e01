/**
 * Chat mode for `generate` in headless Chromium, against a gateway on the tiny model with a chat
 * template (support/gateway.ts `tinyModelCopy`): each reply streams into its bubble as the
 * tokens come, ends as the result's completion, and goes back to the gateway with the history on
 * the next turn; Clear starts again. Screenshots go to test-artifacts/.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Page} from 'playwright-core'

import type {GenerateParams, GenerateResult} from '../src/index.ts'
import {ARTIFACTS, finished, launch, rawResult} from './support/browser.ts'
import {startGateway, tinyModelCopy, type Gateway} from './support/gateway.ts'

let gateway: Gateway
let context: BrowserContext
let scratch: string

type Watched = Page & {errors: string[]; sent: GenerateParams[]}

async function open(): Promise<Watched> {
  const page = (await context.newPage()) as Watched
  await page.setViewportSize({width: 1280, height: 900})
  page.errors = []
  page.sent = []
  page.on('pageerror', (error) => page.errors.push(error.message))
  page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
  page.on('request', (request) => {
    const url = new URL(request.url())
    if (url.pathname.endsWith('/generate/run')) page.sent.push(JSON.parse(url.searchParams.get('params')!) as GenerateParams)
  })
  await page.goto(`${gateway.url}/#generate`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')
  await page.locator('.modes label', {hasText: 'Chat'}).click()
  await page.locator('.chat').waitFor()
  // Each time the newest assistant bubble's text grows: the text, and whether it was still streaming.
  await page.evaluate(() => {
    const seen: {text: string; streaming: boolean}[][] = []
    ;(window as unknown as {seen: typeof seen}).seen = seen
    new MutationObserver(() => {
      const bubbles = document.querySelectorAll('.chat-log .bubble.assistant')
      const bubble = bubbles[bubbles.length - 1]
      if (!bubble) return
      const turn = (seen[bubbles.length - 1] ??= [])
      const text = bubble.querySelector('.bubble-text')?.textContent ?? ''
      if (text && text !== turn.at(-1)?.text) turn.push({text, streaming: bubble.classList.contains('streaming')})
    }).observe(document.querySelector('.chat-log')!, {subtree: true, childList: true, characterData: true, attributes: true})
  })
  return page
}

/** Send `text` (with Enter, or the Send button), wait for the reply; the job's card and result. */
async function say(page: Watched, text: string, how: 'enter' | 'click' = 'click') {
  const jobs = await page.locator('article.job').count()
  await page.fill('.chat-message', text)
  if (how === 'enter') await page.press('.chat-message', 'Enter')
  else await page.click('.chat-send')
  await page.waitForFunction((n) => document.querySelectorAll('article.job').length > n, jobs)
  const job = page.locator('article.job').first()
  await finished(job)
  await page.locator('.chat-send:not([disabled])').waitFor()
  return {job, result: await rawResult<GenerateResult>(job), params: page.sent.at(-1)!}
}

const streamedTurns = (page: Page) => page.evaluate(() => (window as unknown as {seen: {text: string; streaming: boolean}[][]}).seen)
const bubbles = (page: Page) =>
  page.locator('.chat-log .bubble').evaluateAll((items) => items.map((b) => ({role: b.getAttribute('data-role'), text: b.querySelector('.bubble-text')?.textContent ?? ''})))

describe('the dashboard’s chat mode', () => {
  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-chat-'))
    // --max-batch-size 1: each turn decodes alone, as the test reads its tokens.
    gateway = await startGateway(['--max-batch-size', '1'], tinyModelCopy(join(scratch, 'chat-model'), true))
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('a reply streams into its bubble and is the completion; the next turn sends the history', async () => {
    const page = await open()
    assert.ok(await page.locator('[data-field=prompts]').isHidden())
    await page.fill('.chat textarea[id$=-system]', 'Be brief.')
    // The tiny model's context is 256 bytes (a token each): room for two short turns.
    await page.fill('[data-field=max_tokens] input', '20')
    await page.fill('[data-field=temperature] input', '0.8')
    await page.fill('[data-field=seed] input', '7')

    const first = await say(page, 'Who are you?')
    assert.deepEqual(first.params.messages, [
      {role: 'system', content: 'Be brief.'},
      {role: 'user', content: 'Who are you?'},
    ])
    assert.equal(first.params.prompts, undefined)
    assert.equal(first.params.max_tokens, 20)
    assert.equal(first.params.temperature, 0.8)
    assert.equal(first.params.seed, 7)
    assert.equal(first.result.completions.length, 1)
    const reply = first.result.completions[0]!
    assert.ok(reply.length > 0)
    // Streamed: the bubble grew token by token, each text the one before plus more, up to the completion.
    const [turn] = await streamedTurns(page)
    const streamed = turn!.filter((s) => s.streaming)
    assert.ok(streamed.length >= 5, `the reply grew only ${streamed.length} times while streaming`)
    for (let i = 1; i < streamed.length; i++) assert.ok(streamed[i]!.text.startsWith(streamed[i - 1]!.text))
    assert.equal(streamed.at(-1)!.text, reply)
    assert.deepEqual(await bubbles(page), [
      {role: 'user', text: 'Who are you?'},
      {role: 'assistant', text: reply},
    ])
    assert.equal(await page.locator('.chat-message').inputValue(), '')
    assert.ok(await page.locator('.chat-log .bubble.assistant .finish').isVisible())

    // The second turn, sent with Enter: the whole conversation goes, the first reply as the gateway gave it.
    const second = await say(page, 'What next?', 'enter')
    assert.deepEqual(second.params.messages, [
      {role: 'system', content: 'Be brief.'},
      {role: 'user', content: 'Who are you?'},
      {role: 'assistant', content: reply},
      {role: 'user', content: 'What next?'},
    ])
    const secondReply = second.result.completions[0]!
    const turns = await streamedTurns(page)
    assert.equal(turns[1]!.filter((s) => s.streaming).at(-1)!.text, secondReply)
    assert.deepEqual((await bubbles(page)).slice(2), [
      {role: 'user', text: 'What next?'},
      {role: 'assistant', text: secondReply},
    ])
    // The job's card says what it answered.
    assert.equal(await second.job.locator('.result .chat-context').innerText(), 'The reply to 4 messages, the last: What next?')
    assert.equal(await second.job.locator('.result .completion-text').textContent(), secondReply)
    await page.screenshot({path: join(ARTIFACTS, 'chat.png'), fullPage: true})

    // Clear: a new conversation, the system prompt kept.
    await page.click('.chat-clear')
    assert.equal(await page.locator('.chat-log .bubble').count(), 0)
    const fresh = await say(page, 'Hi again')
    assert.deepEqual(fresh.params.messages, [
      {role: 'system', content: 'Be brief.'},
      {role: 'user', content: 'Hi again'},
    ])
    assert.equal((await bubbles(page)).length, 2)

    // Back to prompts: the form runs prompts as before.
    await page.locator('.modes label', {hasText: 'Prompts'}).click()
    assert.ok(await page.locator('.chat').isHidden())
    assert.ok(await page.locator('[data-field=prompts]').isVisible())
    await page.click('#run button[type=submit]')
    await page.waitForFunction(() => document.querySelector('article.job')?.querySelector('.request')?.textContent?.includes('"prompts"'))
    await finished(page.locator('article.job').first())
    assert.equal(page.sent.at(-1)!.messages, undefined)
    assert.deepEqual(page.errors, [])
    await page.close()
  })

  test('an invalid param in chat mode: the 422 on its field and in the conversation; the message kept for another try', async () => {
    const page = await open()
    await page.fill('[data-field=max_tokens] input', '0')
    await page.fill('.chat-message', 'Hello')
    await page.click('.chat-send')
    const error = page.locator('.chat-error')
    await error.waitFor()
    assert.equal(await error.locator('.code').innerText(), '422 invalid_params')
    assert.equal(await page.locator('[data-field=max_tokens] .field-error').innerText(), 'max_tokens: expected `int` >= 1')
    assert.equal(await page.locator('.chat-log .bubble').count(), 0)
    assert.equal(await page.locator('.chat-message').inputValue(), 'Hello')
    // Put right, the same message goes through.
    await page.fill('[data-field=max_tokens] input', '8')
    const {result} = await say(page, 'Hello')
    assert.ok(await error.isHidden())
    assert.deepEqual(await bubbles(page), [
      {role: 'user', text: 'Hello'},
      {role: 'assistant', text: result.completions[0]!},
    ])
    assert.deepEqual(page.errors.filter((e) => !/status of 422/.test(e)), [])
    await page.close()
  })
})
