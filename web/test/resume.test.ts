/**
 * Resuming after a dropped connection, against a fetch that answers from memory: every fixture
 * stream cut at every byte and resumed gives what an uninterrupted run gives, each event once;
 * and the rules around it (Idempotency-Key, bounded tries, backoff, what is not retried).
 */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {
  AbortError,
  HttpError,
  ProtocolError,
  runAndStream,
  StreamEndedError,
  TimeoutError,
  type ResumeInfo,
  type RunOptions,
} from '../src/index.ts'
import {fakeFetch, type Call, type FakeAnswer} from './support/fake.ts'
import {FIXTURES, GENERATE, JOB, NOISE} from './fixtures.ts'
import {check, failure, play, settle} from './support/play.ts'

const URL_ = 'http://gateway.test/api/generate/run'
const EVENTS_URL = `http://gateway.test/api/jobs/${JOB}/events`
const SSE = {'Content-Type': 'text/event-stream; charset=utf-8', 'X-Job-Id': JOB}
const encoder = new TextEncoder()
const FAST = {delayMs: 0}

/** The blocks of a stream (each up to and including its blank line), as a gateway stores them. */
function blocks(stream: string): string[] {
  return stream.split(/(?<=\n\n)/)
}

/** What `GET /jobs/{id}/events` answers: every block after the one with `lastEventId`, or all. */
function after(stream: string, lastEventId: string | null): string {
  const all = blocks(stream)
  if (lastEventId === null) return all.join('')
  const at = all.map((block) => block.includes(`id: ${lastEventId}\n`)).lastIndexOf(true)
  assert.ok(at >= 0, `the client resumed after ${lastEventId}, which the stream never sent`)
  return all.slice(at + 1).join('')
}

const playAt = (fetch: typeof globalThis.fetch, options: RunOptions = {}) => play(URL_, fetch, {resume: FAST, ...options})

describe('a stream cut anywhere resumes to the uninterrupted run', () => {
  // NOISE has an event whose id is not the gateway's `<job>:<seq>`: no client can resume after it.
  for (const fixture of FIXTURES.filter((f) => f !== NOISE)) {
    test(`${fixture.name}: cut at every byte, by a broken socket and by a clean close`, async () => {
      const bytes = encoder.encode(fixture.stream)
      for (let cut = 0; cut <= bytes.length; cut++) {
        for (const broken of [true, false]) {
          const where = `cut at byte ${cut} (${broken ? 'broken' : 'closed'})`
          const {fetch, calls} = fakeFetch((call: Call): FakeAnswer => {
            if (call.method === 'POST') {
              return {headers: SSE, chunks: [bytes.slice(0, cut)], ...(broken ? {breakWith: new Error('reset')} : {})}
            }
            assert.equal(call.url, EVENTS_URL, where)
            return {headers: SSE, chunks: [after(fixture.stream, call.headers.get('last-event-id'))]}
          })
          const seen = await playAt(fetch)
          check(seen, fixture.expected, where)
          const gets = calls.filter((c) => c.method === 'GET')
          assert.ok(gets.length <= 1, `${where}: ${gets.length} reconnects`)
          assert.equal(seen.resumes.length, gets.length, where)
          // Without a Last-Event-ID the gateway replays from the first event; with one, after it.
          const last = gets[0]?.headers.get('last-event-id')
          if (last !== null && last !== undefined) assert.match(last, new RegExp(`^${JOB}:\\d+$`), where)
        }
      }
    })
  }

  test('a reconnect that loses its Last-Event-ID on the way (replayed from the start) still counts each event once', async () => {
    const bytes = encoder.encode(GENERATE.stream)
    for (let cut = 0; cut <= bytes.length; cut += 7) {
      const {fetch} = fakeFetch((call) =>
        call.method === 'POST'
          ? {headers: SSE, chunks: [bytes.slice(0, cut)], breakWith: new Error('reset')}
          : {headers: SSE, chunks: [GENERATE.stream]},
      )
      check(await playAt(fetch), GENERATE.expected, `cut at byte ${cut}`)
    }
  })

  test('dropped after every event in turn: each reconnect asks after the last event read', async () => {
    // Each connection sends the blocks up to the next event with an id, then breaks.
    const {fetch, calls} = fakeFetch((call) => {
      const rest = blocks(call.method === 'POST' ? GENERATE.stream : after(GENERATE.stream, call.headers.get('last-event-id')))
      const upTo = rest.findIndex((block) => block.includes('\nid: ') || block.startsWith('id: '))
      const more = upTo + 1 < rest.length
      return {headers: SSE, chunks: [rest.slice(0, upTo + 1).join('')], ...(more ? {breakWith: new Error('reset')} : {})}
    })
    const seen = await playAt(fetch, {resume: {tries: 1, delayMs: 0}})
    check(seen, GENERATE.expected, 'one event per connection')
    const asked = calls.filter((c) => c.method === 'GET').map((c) => c.headers.get('last-event-id'))
    assert.deepEqual(asked, Array.from({length: 9}, (_, i) => `${JOB}:${i + 1}`))
  })
})

describe('the POST and its Idempotency-Key', () => {
  test('each run sends a fresh random key; a given key is used as is', async () => {
    const keys: (string | null)[] = []
    for (const idempotencyKey of [undefined, undefined, 'my-key-1']) {
      const {fetch, calls} = fakeFetch(() => ({headers: SSE, chunks: [`id: ${JOB}:1\nevent: data\ndata: 1\n\n`]}))
      assert.equal(await runAndStream(URL_, {}, {fetch, idempotencyKey}), 1)
      keys.push(calls[0]!.headers.get('idempotency-key'))
    }
    assert.match(keys[0]!, /^[0-9a-f]{32}$/)
    assert.match(keys[1]!, /^[0-9a-f]{32}$/)
    assert.notEqual(keys[0], keys[1])
    assert.equal(keys[2], 'my-key-1')
  })

  test('a POST whose answer never came is sent again, with the same key and body', async () => {
    let posts = 0
    const {fetch, calls} = fakeFetch(() =>
      ++posts === 1 ? new TypeError('fetch failed') : {headers: SSE, chunks: [GENERATE.stream]},
    )
    const seen = await playAt(fetch)
    check(seen, GENERATE.expected, 'replayed POST')
    assert.deepEqual(calls.map((c) => c.method), ['POST', 'POST'])
    assert.equal(calls[0]!.headers.get('idempotency-key'), calls[1]!.headers.get('idempotency-key'))
    assert.equal(calls[0]!.body, calls[1]!.body)
    assert.equal(seen.resumes.length, 1)
    assert.match(String(seen.resumes[0]!.error.message), /could not reach the gateway/)
  })

  test('without X-Job-Id (hidden cross-origin), a drop before any event POSTs again; after one, reconnects by the id in the events', async () => {
    const noHeader = {'Content-Type': 'text/event-stream'}
    const firstBlock = blocks(GENERATE.stream).slice(0, 2).join('') // the retry hint and RECEIVED
    let posts = 0
    const {fetch, calls} = fakeFetch((call) => {
      if (call.method === 'POST') {
        posts += 1
        return posts === 1
          ? {headers: noHeader, chunks: ['retry: 3000\n\n'], breakWith: new Error('reset')}
          : {headers: noHeader, chunks: [firstBlock], breakWith: new Error('reset')}
      }
      return {headers: noHeader, chunks: [after(GENERATE.stream, call.headers.get('last-event-id'))]}
    })
    check(await playAt(fetch), GENERATE.expected, 'no X-Job-Id')
    assert.deepEqual(calls.map((c) => `${c.method} ${c.headers.get('last-event-id')}`), ['POST null', 'POST null', `GET ${JOB}:1`])
    assert.equal(calls[0]!.headers.get('idempotency-key'), calls[1]!.headers.get('idempotency-key'))
  })

  test('a refused POST (503) is not sent again: no job started, and retrying is the caller’s choice', async () => {
    const {fetch, calls} = fakeFetch(() => ({
      status: 503,
      headers: {'Content-Type': 'application/json', 'Retry-After': '5'},
      chunks: ['{"error":{"code":"shutting_down","message":"the gateway is shutting down","retryable":true}}'],
    }))
    const error = await failure(runAndStream(URL_, {}, {fetch, resume: FAST}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.code, 'shutting_down')
    assert.equal(error.jobId, undefined)
    assert.equal(calls.length, 1)
  })
})

describe('bounded tries and backoff', () => {
  const dropping = () =>
    fakeFetch((call) => ({
      headers: SSE,
      chunks: call.method === 'POST' ? [blocks(GENERATE.stream).slice(0, 3).join('')] : [],
      breakWith: new Error('reset'),
    }))

  test('a gateway that keeps dropping: gives up after `tries` reconnects in a row, waits doubling to the cap', async () => {
    const {fetch, calls} = dropping()
    const resumes: ResumeInfo[] = []
    const error = await failure(
      runAndStream(URL_, {}, {fetch, resume: {tries: 4, delayMs: 2, maxDelayMs: 5}, onResume: (info) => resumes.push(info)}),
    )
    assert.ok(error instanceof StreamEndedError)
    assert.equal(error.message, 'the stream broke: reset (gave up after 4 reconnects)')
    assert.equal(error.jobId, JOB)
    assert.equal(error.lastEventId, `${JOB}:2`)
    assert.equal(error.jobStatus, 'QUEUED')
    assert.deepEqual(resumes.map((r) => [r.attempt, r.delayMs]), [
      [1, 2],
      [2, 4],
      [3, 5],
      [4, 5],
    ])
    assert.deepEqual(calls.map((c) => c.method), ['POST', 'GET', 'GET', 'GET', 'GET'])
    assert.ok(calls.slice(1).every((c) => c.url === EVENTS_URL && c.headers.get('last-event-id') === `${JOB}:2`))
  })

  test('the default: 5 reconnects, 250 ms doubling', async () => {
    const {fetch} = dropping()
    const resumes: ResumeInfo[] = []
    // The schedule is what is under test, not the waiting: timers fire at once for this run.
    const realSetTimeout = globalThis.setTimeout
    globalThis.setTimeout = ((fn: () => void, _ms?: number) => realSetTimeout(fn, 0)) as typeof setTimeout
    try {
      const error = await failure(runAndStream(URL_, {}, {fetch, onResume: (info) => resumes.push(info)}))
      assert.ok(error instanceof StreamEndedError)
    } finally {
      globalThis.setTimeout = realSetTimeout
    }
    assert.deepEqual(resumes.map((r) => r.delayMs), [250, 500, 1000, 2000, 4000])
  })

  test('a reconnect answered 503 (a replica restarting) tries again; 404 (the job is gone) does not', async () => {
    let gets = 0
    const unavailable: FakeAnswer = {
      status: 503,
      headers: {'Content-Type': 'application/json'},
      chunks: ['{"error":{"code":"not_ready","message":"the store is unreachable","retryable":true}}'],
    }
    const {fetch} = fakeFetch((call) => {
      if (call.method === 'POST') return {headers: SSE, chunks: [blocks(GENERATE.stream).slice(0, 3).join('')], breakWith: new Error('reset')}
      return ++gets < 3 ? unavailable : {headers: SSE, chunks: [after(GENERATE.stream, call.headers.get('last-event-id'))]}
    })
    const seen = await playAt(fetch)
    check(seen, GENERATE.expected, '503 then resumed')
    assert.deepEqual(seen.resumes.map((r) => (r.error instanceof HttpError ? r.error.status : r.error.name)), ['StreamEndedError', 503, 503])

    const gone = fakeFetch((call) =>
      call.method === 'POST'
        ? {headers: SSE, chunks: [blocks(GENERATE.stream).slice(0, 3).join('')], breakWith: new Error('reset')}
        : {status: 404, headers: {'Content-Type': 'application/json'}, chunks: ['{"error":{"code":"not_found","message":"no job","retryable":false}}']},
    )
    const error = await failure(runAndStream(URL_, {}, {fetch: gone.fetch, resume: FAST}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.status, 404)
    assert.equal(error.jobId, JOB, 'a refused reconnect names the job it lost')
    assert.equal(error.lastEventId, `${JOB}:2`)
    assert.equal(gone.calls.length, 2)
  })

  test('resuming off: the first drop is the end', async () => {
    const {fetch, calls} = dropping()
    const error = await failure(runAndStream(URL_, {}, {fetch, resume: false}))
    assert.ok(error instanceof StreamEndedError)
    assert.equal(error.message, 'the stream broke: reset')
    assert.equal(calls.length, 1)
  })

  test('a 204 to a reconnect before the terminal event is a ProtocolError, not a loop', async () => {
    const {fetch, calls} = fakeFetch((call) =>
      call.method === 'POST'
        ? {headers: SSE, chunks: [blocks(GENERATE.stream).slice(0, 3).join('')], breakWith: new Error('reset')}
        : {status: 204, headers: {'X-Job-Id': JOB}},
    )
    const error = await failure(runAndStream(URL_, {}, {fetch, resume: FAST}))
    assert.ok(error instanceof ProtocolError)
    assert.equal(calls.length, 2)
  })

  test('aborting while waiting to reconnect: AbortError at once, the job is cancelled, no reconnect', async () => {
    const {fetch, calls} = dropping()
    const controller = new AbortController()
    const started = Date.now()
    const run = runAndStream(URL_, {}, {fetch, signal: controller.signal, resume: {delayMs: 60_000}, onResume: () => setTimeout(() => controller.abort(), 5)})
    const error = await failure(run)
    assert.ok(error instanceof AbortError)
    assert.equal(error.jobId, JOB)
    assert.ok(Date.now() - started < 5000)
    await settle()
    assert.deepEqual(calls.map((c) => c.method), ['POST', 'DELETE'])
  })

  test('aborting from a callback: no event after it, though its chunk holds more, and the result is not returned', async () => {
    const {fetch, calls} = fakeFetch(() => ({chunks: [encoder.encode(GENERATE.stream)], headers: SSE}))
    const controller = new AbortController()
    const partials: unknown[] = []
    const statuses: string[] = []
    const run = runAndStream(URL_, {}, {
      fetch,
      signal: controller.signal,
      onStatus: (frame) => statuses.push(frame.status),
      onPartial: (partial) => {
        partials.push(partial)
        controller.abort()
      },
    })
    const error = await failure(run)
    assert.ok(error instanceof AbortError, String(error))
    assert.equal(partials.length, 1)
    assert.ok(GENERATE.expected.partials.length > 1, 'the fixture has partials after the first')
    assert.deepEqual(statuses, ['RECEIVED', 'QUEUED', 'RUNNING']) // those before the first partial, none after
    await settle()
    assert.deepEqual(calls.map((c) => c.method), ['POST', 'DELETE'])
  })

  test('timeoutMs covers the reconnects', async () => {
    const {fetch, calls} = dropping()
    const error = await failure(runAndStream(URL_, {}, {fetch, timeoutMs: 50, resume: {tries: 1000, delayMs: 5, maxDelayMs: 5}}))
    assert.ok(error instanceof TimeoutError)
    await settle()
    assert.equal(calls.at(-1)!.method, 'DELETE')
    const count = calls.length
    await new Promise((resolve) => setTimeout(resolve, 30))
    assert.equal(calls.length, count, 'no reconnect after the timeout')
  })
})
