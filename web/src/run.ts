/**
 * `runAndStream`: start a job with `POST /{tool}/run`, follow its event stream, and
 * resolve with the `data` event's payload (or reject with one of the errors in errors.ts).
 */
import {createParser, type EventSourceMessage} from 'eventsource-parser'

import {AbortError, HttpError, JobError, ProtocolError, StreamEndedError, TimeoutError} from './errors.ts'
import type {BuiltinTools, LogFrame, StatusFrame} from './generated/types.ts'
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
  /** Give up (rejecting with `TimeoutError`) and cancel the job after this long. */
  timeoutMs?: number | undefined
  /** Extra request headers, e.g. `{Authorization: 'Bearer …'}`. */
  headers?: HeadersInit | undefined
  /** The fetch to use (default: the global one). */
  fetch?: typeof globalThis.fetch | undefined
}

/**
 * POST `params` to `url` (a gateway's `…/{tool}/run`) and follow the job's stream.
 * Resolves with the result; rejects with `HttpError`, `JobError`, `StreamEndedError`,
 * `AbortError`, `TimeoutError` or `ProtocolError`.
 */
export async function runAndStream<T = unknown, P = unknown>(
  url: string | URL,
  params: unknown,
  options: RunOptions<P> = {},
): Promise<T> {
  const doFetch = options.fetch ?? globalThis.fetch
  const target = resolve(url)
  const tracker = new JobTracker<T, P>(false)
  const controller = new AbortController()
  const {signal, timeoutMs} = options
  let stopped: AbortError | TimeoutError | undefined
  let headerJobId: string | undefined
  let cancelSent = false
  let finished = false
  let stopReading: (() => void) | undefined

  const jobId = () => tracker.state.jobId ?? headerJobId
  const cancelJob = () => {
    const id = jobId()
    if (id === undefined || cancelSent) return
    cancelSent = true
    // Closing the stream only detaches from the job (the gateway cancels it once no client
    // has been attached for its detach grace); DELETE cancels it now. A gateway without the
    // route (404, 405) cancels a job when its stream closes. Any answer is fine.
    void Promise.resolve()
      .then(() => doFetch(new URL(`../jobs/${encodeURIComponent(id)}`, target), {method: 'DELETE', headers: options.headers ?? {}}))
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
  const onAbort = () => stop(new AbortError('aborted', tracker.snapshot(), {cause: signal?.reason}))
  signal?.addEventListener('abort', onAbort, {once: true})
  const timer =
    timeoutMs === undefined ? undefined : setTimeout(() => stop(new TimeoutError(timeoutMs, tracker.snapshot())), timeoutMs)

  try {
    let response: Response
    try {
      const headers = new Headers(options.headers)
      headers.set('Content-Type', 'application/json')
      headers.set('Accept', 'text/event-stream')
      response = await doFetch(target, {method: 'POST', headers, body: JSON.stringify(params), signal: controller.signal})
    } catch (error) {
      throw stopped ?? new StreamEndedError(`could not reach the gateway: ${describe(error)}`, {}, {cause: error})
    }
    if (!response.ok) {
      const error = await HttpError.fromResponse(response)
      throw stopped ?? error
    }
    headerJobId = response.headers.get('X-Job-Id') ?? undefined
    if (stopped) {
      cancelJob() // aborted while the request was on its way: the job exists now
      throw stopped
    }
    const type = response.headers.get('Content-Type') ?? ''
    if (!type.startsWith('text/event-stream') || !response.body) {
      void response.body?.cancel().catch(() => undefined)
      throw new ProtocolError(`expected an event stream, got ${type || 'no Content-Type'}`, {jobId: headerJobId})
    }
    return await follow(response.body)
  } finally {
    finished = true
    if (timer !== undefined) clearTimeout(timer)
    signal?.removeEventListener('abort', onAbort)
  }

  async function follow(body: ReadableStream<Uint8Array>): Promise<T> {
    const pending: EventSourceMessage[] = []
    const parser = createParser({onEvent: (message) => pending.push(message)})
    const decoder = new TextDecoder()
    const reader = body.getReader()
    stopReading = () => void reader.cancel().catch(() => undefined)
    const snapshot = () => ({...tracker.snapshot(), jobId: jobId()})
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
          const event = tracker.observe(message)
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
 * `runAndStream` for a built-in tool, typed by its name: `runTool(base, 'generate', {prompts: ['Hi']})`
 * resolves with a `GenerateResult`, and `onPartial` gets `GeneratePartial`s.
 */
export function runTool<K extends keyof BuiltinTools>(
  baseUrl: string | URL,
  tool: K,
  params: BuiltinTools[K]['params'],
  options: RunOptions<BuiltinTools[K]['partial']> = {},
): Promise<BuiltinTools[K]['result']> {
  const base = resolve(baseUrl)
  if (!base.pathname.endsWith('/')) base.pathname += '/'
  return runAndStream(new URL(`${encodeURIComponent(tool)}/run`, base), params, options)
}

function resolve(url: string | URL): URL {
  const here = (globalThis as {location?: {href: string}}).location?.href
  return new URL(url, here)
}

function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = (error as {cause?: unknown}).cause
    return cause instanceof Error ? `${error.message} (${cause.message})` : error.message
  }
  return String(error)
}
