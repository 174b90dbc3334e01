/**
 * The dashboard against a gateway with client tokens, in headless Chromium (Debian's, driven
 * by playwright-core; no browser is downloaded): the token field after the first 401, tickets
 * for every EventSource, a stream resumed with a fresh ticket after its own expired, a result and
 * a result file downloaded with a ticket of their own, and the token never in a URL.
 */
import assert from 'node:assert/strict'
import {randomBytes} from 'node:crypto'
import {mkdtempSync, readFileSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {type BrowserContext, type Locator, type Page, type Request} from 'playwright-core'

import {ARTIFACTS, finished, launch, run} from './support/browser.ts'
import {startGateway, type Gateway} from './support/gateway.ts'
import {startProxy} from './support/proxy.ts'

const TOKEN = `dash-${randomBytes(24).toString('hex')}`
const TICKET_TTL_S = 2

let gateway: Gateway
let context: BrowserContext
let profile: string

interface Watched {
  page: Page
  /** Every request the page made, in order. */
  requests: Request[]
  /** Each 401 answer's URL. */
  refused: string[]
  /** When each ticket was handed out (Date.now()). */
  tickets: number[]
  errors: string[]
}

/** A page at the dashboard with its requests, 401s, tickets and errors recorded. */
async function open(base = gateway.url): Promise<Watched> {
  const page = await context.newPage()
  await page.setViewportSize({width: 1280, height: 900})
  const watched: Watched = {page, requests: [], refused: [], tickets: [], errors: []}
  page.on('request', (request) => watched.requests.push(request))
  page.on('response', (response) => {
    if (response.status() === 401) watched.refused.push(response.url())
    if (response.url().endsWith('/auth/ticket') && response.ok()) watched.tickets.push(Date.now())
  })
  page.on('pageerror', (error) => watched.errors.push(error.message))
  // Chromium logs a refused request and a dropped stream itself; anything else is the page's fault.
  page.on('console', (m) => m.type() === 'error' && !/status of 401|ERR_INCOMPLETE_CHUNKED_ENCODING/.test(m.text()) && watched.errors.push(m.text()))
  await page.goto(`${base}/#generate`)
  await page.waitForSelector('#run[data-tools=gateway] #form [data-field]') // drawn from the gateway's /tools, not the copy kept from a visit before
  return watched
}

/** Run the form, give the token when the gateway asks for it, and wait for the job to end. */
async function runSignedIn(page: Page): Promise<Locator> {
  const job = await run(page)
  await page.locator('#login').waitFor({state: 'visible'})
  await page.fill('#login input', TOKEN)
  await page.click('#login button[type=submit]')
  await finished(job)
  return job
}

const steps = (job: Locator) => job.locator('.timeline li').evaluateAll((items) => items.map((li) => li.getAttribute('data-status')))

/** No URL the page asked for holds the token; the ones that needed it sent it as a header. */
async function tokenOnlyInHeaders(watched: Watched): Promise<void> {
  assert.ok(watched.requests.length > 0)
  for (const request of watched.requests) assert.ok(!request.url().includes(TOKEN), `the token is in a URL: ${request.method()} ${request.url()}`)
  for (const request of watched.requests.filter((r) => r.url().endsWith('/auth/ticket') || r.method() === 'DELETE')) {
    assert.equal((await request.allHeaders()).authorization, `Bearer ${TOKEN}`, `${request.method()} ${request.url()}`)
  }
}

describe('the dashboard on a gateway with tokens', () => {
  before(async () => {
    // --max-batch-size 1: a job waits behind another instead of joining its batch (the resume test needs a long one).
    gateway = await startGateway(['--tokens', `dash=${TOKEN}`, '--ticket-ttl', String(TICKET_TTL_S), '--retry-ms', '100', '--max-batch-size', '1'])
    profile = mkdtempSync(join(tmpdir(), 'streamgate-chromium-'))
    context = await launch(profile)
  })

  after(async () => {
    await context?.close()
    await gateway?.stop()
    if (profile) rmSync(profile, {recursive: true, force: true})
  })

  test('the token field after the first 401; the token kept in sessionStorage; each stream with its own ticket', async () => {
    const watched = await open()
    const {page} = watched
    assert.ok(await page.locator('#login').isHidden())
    await page.fill('[data-field=prompts] textarea', 'Once upon a time')
    await page.fill('[data-field=max_tokens] input', '24')
    const job = await run(page)
    await page.locator('#login').waitFor({state: 'visible'})
    assert.equal(await page.locator('#login label').innerText(), 'This gateway needs a token')
    assert.equal(await job.locator('.error .code').innerText(), '401 unauthorized')
    assert.equal(await job.locator('.badge').innerText(), 'needs a token')
    assert.equal(await job.getAttribute('data-state'), 'running')
    await page.screenshot({path: join(ARTIFACTS, 'login.png'), fullPage: true})

    await page.fill('#login input', TOKEN)
    await page.click('#login button[type=submit]')
    await finished(job)
    assert.ok(await page.locator('#login').isHidden())
    // Who the token is, from GET /me (its Authorization header, never the URL): a token without a class.
    await page.locator('#whoami').waitFor({state: 'visible'})
    assert.equal(await page.locator('#whoami').innerText(), 'dash')
    assert.deepEqual(await steps(job), ['unauthorized', 'RECEIVED', 'QUEUED', 'RUNNING', 'done'])
    assert.ok(await job.locator('.error').isHidden())
    const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as {completions: string[]}
    assert.equal(await job.locator('.result .completion-text').innerText(), result.completions[0])
    // localStorage keeps the tools listed, never the token.
    assert.deepEqual(await page.evaluate((token) => [sessionStorage.getItem('streamgate.token'), Object.values(localStorage).some((v) => v.includes(token))], TOKEN), [TOKEN, false])

    // The same tab runs and cancels with no prompt: a fresh ticket for the stream, the header on DELETE.
    const tickets = watched.tickets.length
    await page.fill('[data-field=max_tokens] input', '200')
    const second = await run(page)
    await second.locator('.token').first().waitFor()
    await second.locator('button', {hasText: 'Cancel'}).click()
    await finished(second, 'cancelled')
    assert.equal(watched.tickets.length, tickets + 1)
    assert.ok(await page.locator('#login').isHidden())

    const streams = watched.requests.filter((r) => r.method() === 'GET' && r.url().includes('/generate/run?'))
    assert.deepEqual(
      streams.map((r) => new URL(r.url()).searchParams.has('ticket')),
      [false, false, true, true], // the EventSource and the fetch that read its 401, then one stream per job
    )
    assert.ok(watched.requests.some((r) => r.method() === 'DELETE'))
    await tokenOnlyInHeaders(watched)
    assert.deepEqual(watched.errors, [])
    await page.close()
  })

  test('a ticket expired when the connection dropped: the job resumes with a fresh one, nothing lost or doubled', async () => {
    const proxy = await startProxy(gateway.url)
    // A job ahead in the queue, so that the page's job still runs once its ticket has expired.
    const blocker = fetch(`${gateway.url}/generate/run`, {
      method: 'POST',
      headers: {Authorization: `Bearer ${TOKEN}`, 'Content-Type': 'application/json'},
      body: JSON.stringify({prompts: ['A'], max_tokens: 240}),
    }).then((response) => response.text())
    try {
      const watched = await open(proxy.url)
      const {page} = watched
      // sessionStorage is per tab: a new one asks for the token again.
      await page.fill('[data-field=prompts] textarea', 'It was a dark and stormy night')
      await page.fill('[data-field=max_tokens] input', '200')
      // The network stalls after a few tokens (however fast the job runs); past the ticket's
      // life the connection drops, and the browser's own reconnect is then refused.
      proxy.holdAfter('event: partial', 5)
      const job = await run(page)
      await page.locator('#login').waitFor({state: 'visible'})
      await page.fill('#login input', TOKEN)
      await page.click('#login button[type=submit]')
      await job.locator('.token').nth(4).waitFor({state: 'attached', timeout: 60_000}) // a token may have no text of its own
      const issued = watched.tickets.at(-1)!
      await page.waitForTimeout(Math.max(0, issued + TICKET_TTL_S * 1000 + 500 - Date.now()))
      assert.equal(await job.getAttribute('data-state'), 'running', 'the job ended before its ticket expired')
      const tokensBefore = await job.locator('.token').count()
      proxy.drop()
      await finished(job)

      assert.deepEqual(await steps(job), ['unauthorized', 'RECEIVED', 'QUEUED', 'RUNNING', 'reconnecting', 'resumed', 'done'])
      const jobId = (await job.locator('.job-id').getAttribute('title'))!
      // The browser's reconnect on the run URL was refused, and the job picked up on its events with a new ticket.
      assert.ok(
        watched.refused.some((url) => url.includes('/generate/run?') && new URL(url).searchParams.has('ticket')),
        `no refused reconnect: ${watched.refused.join(' ')}`,
      )
      const resumed = watched.requests.filter((r) => r.url().includes(`/jobs/${jobId}/events?`))
      assert.equal(resumed.length, 1)
      const query = new URL(resumed[0]!.url()).searchParams
      assert.ok(query.has('ticket'))
      assert.match(query.get('last_event_id') ?? '', new RegExp(`^${jobId}:\\d+$`))
      assert.equal(watched.tickets.length, 2)

      // One result, the gateway's; every token once, in order.
      const snapshot = (await (await fetch(`${gateway.url}/jobs/${jobId}`, {headers: {Authorization: `Bearer ${TOKEN}`}})).json()) as {
        terminal: {event: string; data: {completions: string[]}}
      }
      assert.equal(snapshot.terminal.event, 'data')
      assert.deepEqual(JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}'), snapshot.terminal.data)
      assert.equal(await job.locator('.result .completion').count(), 1)
      assert.ok((await job.locator('.token').count()) > tokensBefore)
      assert.equal(await job.locator('.tokens .completion-text').textContent(), snapshot.terminal.data.completions[0])
      assert.equal(await job.locator('.badge').innerText(), 'done')
      await page.screenshot({path: join(ARTIFACTS, 'resumed-with-ticket.png'), fullPage: true})
      await tokenOnlyInHeaders(watched)
      assert.deepEqual(watched.errors, [])
      await page.close()
    } finally {
      await blocker.catch(() => undefined)
      await proxy.close()
    }
  })
  test('the result downloads with a fresh ticket at each click, long after the job', async () => {
    const watched = await open()
    const {page} = watched
    await page.fill('[data-field=prompts] textarea', 'The result as a file')
    await page.fill('[data-field=max_tokens] input', '8')
    const job = await runSignedIn(page)
    const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as unknown
    const jobId = (await job.locator('.job-id').getAttribute('title'))!
    const link = job.locator('a.download-result')
    const plain = `${gateway.url}/jobs/${jobId}/result`
    // No ticket waits in the page for a link that may never be followed.
    assert.equal(await link.getAttribute('href'), plain)

    const tickets: string[] = []
    for (const round of [1, 2]) {
      const [download] = await Promise.all([page.waitForEvent('download'), link.click()])
      const url = new URL(download.url())
      assert.equal(`${url.origin}${url.pathname}`, plain)
      tickets.push(url.searchParams.get('ticket') ?? assert.fail(`download ${round} has no ticket: ${download.url()}`))
      assert.equal(await download.failure(), null)
      assert.deepEqual(JSON.parse(readFileSync((await download.path())!, 'utf8')), result)
      // Past the first ticket's life: the second click must not follow it.
      if (round === 1) await page.waitForTimeout(TICKET_TTL_S * 1000 + 500)
    }
    assert.notEqual(tickets[0], tickets[1])
    assert.deepEqual(watched.refused.filter((url) => url.includes('/result')), [])
    await tokenOnlyInHeaders(watched)
    assert.deepEqual(watched.errors, [])
    await page.close()
  })

  test('a file the result names downloads with a ticket of its own, as the result does', async () => {
    const watched = await open()
    const {page} = watched
    await page.selectOption('#tool', 'embed')
    await page.waitForSelector('#form [data-field=file]')
    await page.fill('[data-field=texts] textarea', 'Vectors in a file')
    await page.selectOption('[data-field=pooling] select', 'per_token')
    await page.selectOption('[data-field=file] select', 'npy')
    const job = await runSignedIn(page)
    const result = JSON.parse((await job.locator('.raw pre').textContent()) ?? '{}') as {files?: {name: string; size: number}[]}
    const file = result.files?.find((f) => f.name === 'embeddings.npy') ?? assert.fail(`no embeddings.npy in ${JSON.stringify(result.files)}`)
    const jobId = (await job.locator('.job-id').getAttribute('title'))!
    const plain = `${gateway.url}/jobs/${jobId}/files/embeddings.npy`
    const link = job.locator('header .result-files a.download-file[data-file="embeddings.npy"]')
    assert.equal(await link.getAttribute('href'), plain)
    const [download] = await Promise.all([page.waitForEvent('download'), link.click()])
    const url = new URL(download.url())
    assert.equal(`${url.origin}${url.pathname}`, plain)
    assert.ok(url.searchParams.get('ticket'), `the download has no ticket: ${download.url()}`)
    assert.equal(await download.failure(), null)
    const bytes = readFileSync((await download.path())!)
    assert.equal(bytes.length, file.size)
    assert.equal(bytes.subarray(0, 6).toString('latin1'), '\x93NUMPY')
    assert.deepEqual(watched.refused.filter((url) => url.includes('/files/')), [])
    await tokenOnlyInHeaders(watched)
    assert.deepEqual(watched.errors, [])
    await page.close()
  })
})
