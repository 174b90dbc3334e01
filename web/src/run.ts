/**
 * `runAndStream`: start a job with `POST /{tool}/run`, follow its event stream, and
 * resolve with the `data` event's payload (or reject with one of the errors in errors.ts).
 *
 * A dropped connection does not lose the job: the gateway keeps a job running while no
 * client is attached (for its detach grace), so `runAndStream` reconnects with
 * `GET /jobs/{id}/events` and the last event id it saw, and the stream goes on where it
 * broke, each event once. The POST carries an `Idempotency-Key`, so a POST sent again
 * because its answer never came attaches to the job it may have started rather than
 * starting a second. Reconnects use their own backoff (250 ms doubling to 5 s), not the
 * stream's `retry:` hint: that hint is pitched at browsers' `EventSource`, and a resume
 * is a cheap replay of the job's stored events.
 */
import {createParser, type EventSourceMessage} from 'eventsource-parser'

import {AbortError, HttpError, JobError, ProtocolError, StreamEndedError, TimeoutError} from './errors.ts'
import type {BuiltinTools, LogFrame, SaeTools, StatusFrame} from './generated/types.ts'
import {JobTracker, type JobState} from './job.ts'

export interface RunOptions<P = unknown> {
  /** Each `status` event: RECEIVED, QUEUED (with `position`), RUNNING (with `progress`)… */
  onStatus?: ((frame: StatusFrame, job: Readonly<JobState>) => void) | undefined
  /** Each `log` event. Logs never change the job's status. */
  onLog?: ((frame: LogFrame, job: Readonly<JobState>) => void) | undefined
  /** Each `partial` event (e.g. `generate`'s tokens as they are sampled). */
  onPartial?: ((partial: P, job: Readonly<JobState>) => void) | undefined
  /** Aborting it stops the run (rejecting with `AbortError`) and cancels the job. */
  signal?: AbortSignal | undefined
  /** Give up (rejecting with `TimeoutError`) and cancel the job after this long, reconnects included. */
  timeoutMs?: number | undefined
  /** Extra request headers, e.g. `{Authorization: 'Bearer …'}`. */
  headers?: HeadersInit | undefined
  /** The fetch to use (default: the global one). */
  fetch?: typeof globalThis.fetch | undefined
  /** Reconnecting after a dropped connection: on by default; `false` turns it off. */
  resume?: ResumeOptions | false | undefined
  /** Called before each reconnect, e.g. to show "reconnecting…". */
  onResume?: ((info: ResumeInfo, job: Readonly<JobState>) => void) | undefined
  /** The POST's `Idempotency-Key` (default: a random one for each call). */
  idempotencyKey?: string | undefined
  /**
   * Where the gateway POSTs the job's terminal event once it ends, signed the Standard Webhooks
   * way (its `Callback-URL` header): for a job the caller may stop following.
   */
  callbackUrl?: string | undefined
  /**
   * The served model to run on, by name (`listModels`): sent as the params' `model`, which every
   * tool takes, in place of one they hold. Left out: the params' own, else the gateway's default model.
   */
  model?: string | undefined
}

/** What a plain request to the gateway (`listModels`) takes of `RunOptions`. */
export type RequestOptions = Pick<RunOptions, 'signal' | 'headers' | 'fetch'>

export interface ResumeOptions {
  /** Reconnects in a row, with no event received in between, before giving up (default 5). */
  tries?: number | undefined
  /** The wait before the first reconnect; it doubles after each one that fails (default 250 ms). */
  delayMs?: number | undefined
  /** The longest wait between reconnects (default 5000 ms). */
  maxDelayMs?: number | undefined
}

export interface ResumeInfo {
  /** 1 for the first reconnect since the last event received. */
  attempt: number
  /** How long it waits before reconnecting. */
  delayMs: number
  /** What broke: a `StreamEndedError`, or the `HttpError` (502, 503, 504) of a failed reconnect. */
  error: StreamEndedError | HttpError
}

const RESUME = {tries: 5, delayMs: 250, maxDelayMs: 5000}

/** What a proxy or a restarting replica answers for a moment: a reconnect may try again. */
const TRANSIENT = new Set([502, 503, 504])

/**
 * POST `params` to `url` (a gateway's `…/{tool}/run`) and follow the job's stream, reconnecting
 * if it drops. Resolves with the result; rejects with `HttpError`, `JobError`,
 * `StreamEndedError` (once reconnecting gave up), `AbortError`, `TimeoutError` or `ProtocolError`.
 */
export async function runAndStream<T = unknown, P = unknown>(
  url: string | URL,
  params: unknown,
  options: RunOptions<P> = {},
): Promise<T> {
  const doFetch = options.fetch ?? globalThis.fetch
  const target = resolve(url)
  const body = JSON.stringify(withModel(params, options.model))
  const key = options.idempotencyKey ?? randomKey()
  const given: ResumeOptions = options.resume === false ? {tries: 0} : (options.resume ?? {})
  const resume = {
    tries: given.tries ?? RESUME.tries,
    delayMs: given.delayMs ?? RESUME.delayMs,
    maxDelayMs: given.maxDelayMs ?? RESUME.maxDelayMs,
  }
  const tracker = new JobTracker<T, P>(false)
  const controller = new AbortController()
  const {signal, timeoutMs} = options
  let stopped: AbortError | TimeoutError | undefined
  let headerJobId: string | undefined
  let cancelSent = false
  let finished = false
  let failures = 0
  let stopReading: (() => void) | undefined

  const jobId = () => tracker.state.jobId ?? headerJobId
  const snapshot = () => ({...tracker.snapshot(), jobId: jobId()})
  const jobUrl = (id: string, rest = '') => new URL(`../jobs/${encodeURIComponent(id)}${rest}`, target)
  const cancelJob = () => {
    const id = jobId()
    if (id === undefined || cancelSent) return
    cancelSent = true
    // Closing the stream only detaches from the job (the gateway cancels it once no client
    // has been attached for its detach grace); DELETE cancels it now. A gateway without the
    // route (404, 405) cancels a job when its stream closes. Any answer is fine.
    void Promise.resolve()
      .then(() => doFetch(jobUrl(id), {method: 'DELETE', headers: options.headers ?? {}}))
      .then((response) => response.body?.cancel())
      .catch(() => undefined)
  }
  const stop = (error: AbortError | TimeoutError) => {
    if (stopped || finished) return
    stopped = error
    controller.abort(error)
    stopReading?.() // also ends a read from a fetch that ignores its signal
    cancelJob()
  }

  if (signal?.aborted) throw new AbortError('aborted before the run started', {}, {cause: signal.reason})
  const onAbort = () => stop(new AbortError('aborted', snapshot(), {cause: signal?.reason}))
  signal?.addEventListener('abort', onAbort, {once: true})
  const timer = timeoutMs === undefined ? undefined : setTimeout(() => stop(new TimeoutError(timeoutMs, snapshot())), timeoutMs)

  try {
    for (;;) {
      try {
        return await follow(await open())
      } catch (error) {
        if (stopped) throw stopped
        if (!resumable(error)) throw error
        if (failures >= resume.tries) {
          if (failures === 0 || !(error instanceof StreamEndedError)) throw error
          throw new StreamEndedError(`${error.message} (gave up after ${failures} reconnects)`, snapshot(), {cause: error})
        }
        failures += 1
        const delayMs = Math.min(resume.maxDelayMs, resume.delayMs * 2 ** (failures - 1))
        options.onResume?.({attempt: failures, delayMs, error}, tracker.state)
        await sleep(delayMs, controller.signal)
      }
    }
  } finally {
    finished = true
    if (timer !== undefined) clearTimeout(timer)
    signal?.removeEventListener('abort', onAbort)
  }

  /**
   * The first connection POSTs the params. A reconnect asks for the job's events after the last
   * one seen; while the job's id is still unknown (the POST's answer never came) it POSTs again,
   * with the same `Idempotency-Key`.
   */
  async function open(): Promise<ReadableStream<Uint8Array>> {
    if (stopped) throw stopped
    const id = jobId()
    const headers = new Headers(options.headers)
    headers.set('Accept', 'text/event-stream')
    let where = target
    const init: RequestInit = {method: 'POST', headers, signal: controller.signal}
    if (id === undefined) {
      headers.set('Content-Type', 'application/json')
      headers.set('Idempotency-Key', key)
      if (options.callbackUrl !== undefined) headers.set('Callback-URL', options.callbackUrl)
      init.body = body
    } else {
      const last = tracker.state.lastEventId
      if (last !== undefined) headers.set('Last-Event-ID', last)
      where = jobUrl(id, '/events')
      init.method = 'GET'
    }
    let response: Response
    try {
      response = await doFetch(where, init)
    } catch (error) {
      const what = id === undefined ? 'could not reach the gateway' : `could not reconnect to job ${id}`
      throw stopped ?? new StreamEndedError(`${what}: ${describe(error)}`, snapshot(), {cause: error})
    }
    if (!response.ok) {
      // A refused reconnect names its job, so that the caller knows which one it lost.
      throw stopped ?? (await HttpError.fromResponse(response, Date.now(), id === undefined ? {} : snapshot()))
    }
    headerJobId = response.headers.get('X-Job-Id') ?? headerJobId
    if (stopped) {
      cancelJob() // aborted while the request was on its way: the job exists now
      throw stopped
    }
    if (response.status === 204) {
      throw new ProtocolError(`the gateway answered 204 (no more events) to a reconnect after ${tracker.state.lastEventId}, before the terminal event`, snapshot())
    }
    const type = response.headers.get('Content-Type') ?? ''
    if (!type.startsWith('text/event-stream') || !response.body) {
      void response.body?.cancel().catch(() => undefined)
      throw new ProtocolError(`expected an event stream, got ${type || 'no Content-Type'}`, snapshot())
    }
    return response.body
  }

  async function follow(stream: ReadableStream<Uint8Array>): Promise<T> {
    const pending: EventSourceMessage[] = []
    // A parser for each connection: an event cut off by a drop is discarded, and sent again whole.
    const parser = createParser({onEvent: (message) => pending.push(message)})
    const decoder = new TextDecoder()
    const reader = stream.getReader()
    stopReading = () => void reader.cancel().catch(() => undefined)
    let endsWithCR = false
    try {
      for (;;) {
        let chunk: ReadableStreamReadResult<Uint8Array>
        try {
          chunk = await reader.read()
        } catch (error) {
          throw stopped ?? new StreamEndedError(`the stream broke: ${describe(error)}`, snapshot(), {cause: error})
        }
        if (stopped) throw stopped
        let text = chunk.done ? decoder.decode() : decoder.decode(chunk.value, {stream: true})
        // The parser holds back a CR that ends its input (a CRLF may be split); at the end of
        // the stream that CR ends its line, as a CRLF would.
        if (chunk.done && endsWithCR) text += '\n'
        if (text) endsWithCR = text.endsWith('\r')
        parser.feed(text)
        for (const message of pending.splice(0)) {
          // A callback that aborts the run hears nothing more, though the chunk held more events.
          if (stopped) throw stopped
          const event = tracker.observe(message)
          if (event) failures = 0 // the stream moves: the next drop starts a fresh count
          switch (event?.type) {
            case 'status':
              options.onStatus?.(event.frame, tracker.state)
              break
            case 'log':
              options.onLog?.(event.frame, tracker.state)
              break
            case 'partial':
              options.onPartial?.(event.partial, tracker.state)
              break
            case 'data':
              return event.result
            case 'error':
              throw new JobError(event.error, snapshot())
          }
        }
        if (chunk.done) {
          // An event cut off at the end of the stream (no blank line after it) is discarded, as browsers do.
          throw new StreamEndedError('the stream ended before the job did', snapshot())
        }
      }
    } finally {
      void reader.cancel().catch(() => undefined)
    }
  }
}

/**
 * Worth a reconnect: a dropped or unreachable stream, or a reconnect refused for a moment by a
 * proxy or a restarting replica. A refused POST is not: no job started, and the caller decides.
 */
function resumable(error: unknown): error is StreamEndedError | HttpError {
  return error instanceof StreamEndedError || (error instanceof HttpError && error.jobId !== undefined && TRANSIENT.has(error.status))
}

type Tools = BuiltinTools & SaeTools

/**
 * `runAndStream` for a built-in tool, typed by its name: `runTool(base, 'generate', {prompts: ['Hi']})`
 * resolves with a `GenerateResult`, and `onPartial` gets `GeneratePartial`s. The SAE tools
 * (`sae_annotate`, …) are typed too; they exist only on a gateway started with `--sae`.
 */
export function runTool<K extends keyof Tools>(
  baseUrl: string | URL,
  tool: K,
  params: Tools[K]['params'],
  options: RunOptions<Tools[K]['partial']> = {},
): Promise<Tools[K]['result']> {
  return runAndStream(gatewayUrl(baseUrl, `${encodeURIComponent(tool)}/run`), params, options)
}

/** `path` under a gateway's base URL (`http://host/prefix` and `http://host/prefix/` alike). */
export function gatewayUrl(baseUrl: string | URL, path: string): URL {
  const base = resolve(baseUrl)
  if (!base.pathname.endsWith('/')) base.pathname += '/'
  return new URL(path, base)
}

/** `params` with `model` set, for the `model` option: every tool's params are an object that takes one. */
function withModel(params: unknown, model: string | undefined): unknown {
  if (model === undefined) return params
  if (typeof params !== 'object' || params === null || Array.isArray(params)) {
    throw new TypeError(`the model option needs params that are an object, not ${Array.isArray(params) ? 'an array' : String(params)}`)
  }
  return {...params, model}
}

function resolve(url: string | URL): URL {
  const here = (globalThis as {location?: {href: string}}).location?.href
  return new URL(url, here)
}

/** Waits `ms`, or less if `signal` aborts (the caller then finds the run stopped). */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted || ms <= 0) return resolve()
    const done = () => {
      clearTimeout(timer)
      signal.removeEventListener('abort', done)
      resolve()
    }
    const timer = setTimeout(done, ms)
    signal.addEventListener('abort', done, {once: true})
  })
}

/** 128 random bits in hex (`crypto.randomUUID` exists only in secure contexts; `getRandomValues` everywhere). */
function randomKey(): string {
  return Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('')
}

function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = (error as {cause?: unknown}).cause
    return cause instanceof Error ? `${error.message} (${cause.message})` : error.message
  }
  return String(error)
}
