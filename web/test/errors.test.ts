/** The typed errors, aborting, timeouts and cancelling, against a fetch that answers from memory. */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {
  AbortError,
  HttpError,
  JobTracker,
  parseRetryAfter,
  ProtocolError,
  runAndStream,
  runTool,
  StreamEndedError,
  TimeoutError,
} from '../src/index.ts'
import {fakeFetch, type Call, type FakeAnswer} from './support/fake.ts'
import {JOB} from './fixtures.ts'
import {failure, settle} from './support/play.ts'

const URL_ = 'http://gateway.test/api/generate/run'
const SSE = {'Content-Type': 'text/event-stream; charset=utf-8', 'X-Job-Id': JOB}
const RECEIVED = `retry: 3000\n\nid: ${JOB}:1\nevent: status\ndata: {"job_id":"${JOB}","seq":1,"status":"RECEIVED","ts":1}\n\n`
const RUNNING = `id: ${JOB}:2\nevent: status\ndata: {"job_id":"${JOB}","seq":2,"status":"RUNNING","ts":2}\n\n`

/** Runs route a POST to `post` and a DELETE to `del` (404 JSON by default, as today's gateway answers). */
function gateway(post: FakeAnswer | Error, del: FakeAnswer | Error = notFound()) {
  return fakeFetch((call: Call) => (call.method === 'DELETE' ? del : post))
}

function notFound(): FakeAnswer {
  return {
    status: 404,
    headers: {'Content-Type': 'application/json'},
    chunks: ['{"error":{"code":"not_found","message":"Not Found","retryable":false}}'],
  }
}


describe('HttpError: refusals before the stream', () => {
  test('422 carries the status, code, message and field of the JSON body', async () => {
    const body = {error: {code: 'invalid_params', message: 'max_tokens: expected `int` >= 1', retryable: false, field: 'max_tokens'}}
    const {fetch} = gateway({status: 422, headers: {'Content-Type': 'application/json'}, chunks: [JSON.stringify(body)]})
    const error = await failure(runAndStream(URL_, {prompts: ['x'], max_tokens: 0}, {fetch}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.name, 'HttpError')
    assert.equal(error.status, 422)
    assert.equal(error.code, 'invalid_params')
    assert.equal(error.message, 'max_tokens: expected `int` >= 1')
    assert.equal(error.field, 'max_tokens')
    assert.equal(error.retryable, false)
    assert.equal(error.retryAfter, undefined)
    assert.deepEqual(error.body, body)
  })

  test('429 with Retry-After in seconds', async () => {
    const {fetch} = gateway({
      status: 429,
      headers: {'Content-Type': 'application/json', 'Retry-After': '7'},
      chunks: ['{"error":{"code":"queue_full","message":"the queue is full","retryable":true}}'],
    })
    const error = await failure(runAndStream(URL_, {}, {fetch}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.status, 429)
    assert.equal(error.code, 'queue_full')
    assert.equal(error.retryable, true)
    assert.equal(error.retryAfter, 7)
    assert.equal(error.field, undefined)
  })

  test('Retry-After as an HTTP date, and nonsense', () => {
    const now = Date.parse('2026-01-01T00:00:00Z')
    assert.equal(parseRetryAfter('Thu, 01 Jan 2026 00:00:30 GMT', now), 30)
    assert.equal(parseRetryAfter('Wed, 31 Dec 2025 23:00:00 GMT', now), 0)
    assert.equal(parseRetryAfter(' 12 ', now), 12)
    assert.equal(parseRetryAfter('soon', now), undefined)
    assert.equal(parseRetryAfter(null, now), undefined)
  })

  test('a body that is not the protocol (a proxy page) still gives the status', async () => {
    const {fetch} = gateway({status: 502, headers: {'Content-Type': 'text/html'}, chunks: ['<h1>Bad Gateway</h1>']})
    const error = await failure(runAndStream(URL_, {}, {fetch}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.status, 502)
    assert.equal(error.code, undefined)
    assert.match(error.message, /^HTTP 502/)
    assert.equal(error.body, '<h1>Bad Gateway</h1>')
    assert.equal(error.retryable, false)
  })

  test('503 without a body is retryable', async () => {
    const {fetch} = gateway({status: 503, headers: {}, chunks: []})
    const error = await failure(runAndStream(URL_, {}, {fetch}))
    assert.ok(error instanceof HttpError)
    assert.equal(error.retryable, true)
  })
})

describe('the request', () => {
  test('POSTs the params as JSON with the caller headers', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED, `id: ${JOB}:2\nevent: data\ndata: {"ok":true}\n\n`]})
    const result = await runAndStream(URL_, {prompts: ['hi']}, {fetch, headers: {Authorization: 'Bearer t0ken'}})
    assert.deepEqual(result, {ok: true})
    assert.equal(calls.length, 1)
    const [call] = calls
    assert.equal(call!.method, 'POST')
    assert.equal(call!.url, URL_)
    assert.equal(call!.body, '{"prompts":["hi"]}')
    assert.equal(call!.headers.get('authorization'), 'Bearer t0ken')
    assert.equal(call!.headers.get('content-type'), 'application/json')
    assert.equal(call!.headers.get('accept'), 'text/event-stream')
  })

  test('runTool builds the URL from a base with or without a trailing slash', async () => {
    for (const base of ['http://gateway.test/api', 'http://gateway.test/api/']) {
      const {fetch, calls} = gateway({headers: SSE, chunks: [`event: data\ndata: {"predictions":[]}\n\n`]})
      const result = await runTool(base, 'predict', {prompt: 'x', top_k: 3}, {fetch})
      assert.deepEqual(result.predictions, [])
      assert.equal(calls[0]!.url, 'http://gateway.test/api/predict/run')
    }
  })
})

describe('AbortError and cancelling the job', () => {
  test('an already aborted signal never sends the request', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED]})
    const controller = new AbortController()
    controller.abort(new Error('changed my mind'))
    const error = await failure(runAndStream(URL_, {}, {fetch, signal: controller.signal}))
    assert.ok(error instanceof AbortError)
    assert.equal(calls.length, 0)
  })

  test('aborting mid-stream rejects with AbortError and DELETEs the job (404 tolerated)', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED, RUNNING], hang: true})
    const controller = new AbortController()
    const statuses: string[] = []
    const run = runAndStream(URL_, {}, {
      fetch,
      signal: controller.signal,
      headers: {Authorization: 'Bearer t0ken'},
      onStatus: (frame) => {
        statuses.push(frame.status)
        if (frame.status === 'RUNNING') controller.abort('stop')
      },
    })
    const error = await failure(run)
    assert.ok(error instanceof AbortError)
    assert.equal(error.name, 'AbortError')
    assert.equal(error.jobId, JOB)
    assert.equal(error.jobStatus, 'RUNNING')
    assert.equal(error.cause, 'stop')
    assert.deepEqual(statuses, ['RECEIVED', 'RUNNING'])
    await settle()
    const del = calls.filter((c) => c.method === 'DELETE')
    assert.equal(del.length, 1)
    assert.equal(del[0]!.url, `http://gateway.test/api/jobs/${JOB}`)
    assert.equal(del[0]!.headers.get('authorization'), 'Bearer t0ken')
  })

  const answers: [string, FakeAnswer | Error][] = [
    ['405', {status: 405, headers: {}, chunks: []}],
    ['204', {status: 204, headers: {}, chunks: []}],
    ['a network error', new TypeError('fetch failed')],
  ]
  for (const [name, answer] of answers) {
    test(`a DELETE answered with ${name} changes nothing`, async () => {
      const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED], hang: true}, answer)
      const controller = new AbortController()
      const run = runAndStream(URL_, {}, {fetch, signal: controller.signal, onStatus: () => controller.abort()})
      assert.ok((await failure(run)) instanceof AbortError)
      await settle()
      assert.equal(calls.filter((c) => c.method === 'DELETE').length, 1)
    })
  }

  test('without X-Job-Id (a cross-origin response hides it) the job id comes from the events', async () => {
    const {fetch, calls} = gateway({headers: {'Content-Type': 'text/event-stream'}, chunks: [RECEIVED], hang: true})
    const controller = new AbortController()
    const run = runAndStream(URL_, {}, {fetch, signal: controller.signal, onStatus: () => controller.abort()})
    assert.equal((await failure(run)).jobId, JOB)
    await settle()
    assert.equal(calls.find((c) => c.method === 'DELETE')?.url, `http://gateway.test/api/jobs/${JOB}`)
  })

  test('an abort before any event, with no job id known yet, sends no DELETE', async () => {
    const {fetch, calls} = gateway({headers: {'Content-Type': 'text/event-stream'}, chunks: [], hang: true})
    const controller = new AbortController()
    const run = runAndStream(URL_, {}, {fetch, signal: controller.signal})
    setTimeout(() => controller.abort(), 5)
    assert.ok((await failure(run)) instanceof AbortError)
    await settle()
    assert.equal(calls.filter((c) => c.method === 'DELETE').length, 0)
  })

  test('aborting after the result changes nothing', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED, `event: data\ndata: 1\n\n`]})
    const controller = new AbortController()
    assert.equal(await runAndStream(URL_, {}, {fetch, signal: controller.signal}), 1)
    controller.abort()
    await settle()
    assert.equal(calls.length, 1)
  })
})

describe('TimeoutError', () => {
  test('a job that does not end in time is abandoned and cancelled', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED, RUNNING], hang: true})
    const started = Date.now()
    const error = await failure(runAndStream(URL_, {}, {fetch, timeoutMs: 50}))
    assert.ok(error instanceof TimeoutError)
    assert.equal(error.timeoutMs, 50)
    assert.equal(error.jobStatus, 'RUNNING')
    assert.ok(Date.now() - started < 2000)
    await settle()
    assert.equal(calls.filter((c) => c.method === 'DELETE').length, 1)
  })

  test('the timeout also covers a gateway that never answers', async () => {
    const hanging: typeof globalThis.fetch = (_input, init) =>
      new Promise((_, reject) => init?.signal?.addEventListener('abort', () => reject(init.signal?.reason)))
    const error = await failure(runAndStream(URL_, {}, {fetch: hanging, timeoutMs: 30}))
    assert.ok(error instanceof TimeoutError)
  })
})

describe('StreamEndedError and ProtocolError', () => {
  test('a gateway that cannot be reached: the POST is tried again, then StreamEndedError', async () => {
    const {fetch, calls} = gateway(new TypeError('fetch failed', {cause: new Error('ECONNREFUSED')}))
    const error = await failure(runAndStream(URL_, {}, {fetch, resume: {tries: 2, delayMs: 1}}))
    assert.ok(error instanceof StreamEndedError)
    assert.match(error.message, /^could not reach the gateway: fetch failed \(ECONNREFUSED\) \(gave up after 2 reconnects\)$/)
    assert.equal(error.jobId, undefined)
    assert.deepEqual(calls.map((c) => c.method), ['POST', 'POST', 'POST'])
  })

  test('a stream that breaks mid-way, with resuming off', async () => {
    const {fetch, calls} = gateway({headers: SSE, chunks: [RECEIVED, RUNNING], breakWith: new Error('socket hang up')})
    const error = await failure(runAndStream(URL_, {}, {fetch, resume: false}))
    assert.ok(error instanceof StreamEndedError)
    assert.equal(error.message, 'the stream broke: socket hang up')
    assert.equal(error.jobStatus, 'RUNNING')
    assert.equal(error.jobId, JOB)
    assert.equal(error.lastEventId, `${JOB}:2`)
    assert.equal(calls.length, 1)
  })

  test('a 200 that is not an event stream', async () => {
    const {fetch} = gateway({headers: {'Content-Type': 'text/html'}, chunks: ['<html>']})
    const error = await failure(runAndStream(URL_, {}, {fetch}))
    assert.ok(error instanceof ProtocolError)
  })

  test('a frame whose data is not JSON', async () => {
    const {fetch} = gateway({headers: SSE, chunks: [RECEIVED, 'event: status\ndata: {oops\n\n']})
    const error = await failure(runAndStream(URL_, {}, {fetch}))
    assert.ok(error instanceof ProtocolError)
    assert.equal(error.jobId, JOB)
  })

  test('a callback that throws fails the run with its error', async () => {
    const {fetch} = gateway({headers: SSE, chunks: [RECEIVED], hang: true})
    const boom = new Error('boom')
    const error = await failure(runAndStream(URL_, {}, {fetch, onStatus: () => { throw boom }}))
    assert.equal(error, boom)
  })
})

describe('JobTracker', () => {
  test('the timeline keeps changes of status and position, not every progress frame', () => {
    const tracker = new JobTracker()
    const frames = [
      {status: 'RECEIVED'},
      {status: 'QUEUED', position: 2, queue_size: 2},
      {status: 'QUEUED', position: 1, queue_size: 1},
      {status: 'RUNNING'},
      {status: 'RUNNING', progress: {done: 1, total: 2}},
      {status: 'RUNNING', progress: {done: 2, total: 2}},
    ]
    frames.forEach((frame, i) =>
      tracker.observe({event: 'status', id: `${JOB}:${i + 1}`, data: JSON.stringify({job_id: JOB, seq: i + 1, ts: i, ...frame})}),
    )
    const state = tracker.state
    assert.deepEqual(state.timeline.map((f) => [f.status, f.position]), [
      ['RECEIVED', undefined],
      ['QUEUED', 2],
      ['QUEUED', 1],
      ['RUNNING', undefined],
    ])
    assert.deepEqual(state.progress, {done: 2, total: 2})
    assert.equal(state.position, undefined)
    assert.equal(state.lastEventId, `${JOB}:6`)
  })
})
