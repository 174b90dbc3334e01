/**
 * The ways a run can fail, as classes a caller can tell apart with `instanceof`
 * or by switching on `error.name`:
 *
 * | class              | when                                                             |
 * | ------------------ | ---------------------------------------------------------------- |
 * | `HttpError`        | the gateway refused the request, or a reconnect, before the stream opened (4xx/5xx) |
 * | `JobError`         | the job ended with an `error` event                              |
 * | `StreamEndedError` | the stream ended, or could not be opened, without a terminal event, and reconnecting gave up |
 * | `AbortError`       | the caller's `signal` aborted the run                            |
 * | `TimeoutError`     | `timeoutMs` passed before the job ended                          |
 * | `ProtocolError`    | the answer was not the protocol's (not an event stream, bad JSON) |
 */
import type {Code, ErrorInfo, Status} from './generated/types.ts'

export type RunError = HttpError | JobError | StreamEndedError | AbortError | TimeoutError | ProtocolError

/** What is known of the job when a run fails: its id and last status, once the stream said so. */
export interface JobSnapshot {
  jobId?: string | undefined
  status?: Status | undefined
  lastEventId?: string | undefined
}

export abstract class StreamgateError extends Error {
  abstract override readonly name: RunError['name']
  readonly jobId: string | undefined
  /** The job's last status before the failure (undefined before the stream opened). */
  readonly jobStatus: Status | undefined
  readonly lastEventId: string | undefined

  constructor(message: string, job: JobSnapshot = {}, options?: {cause?: unknown}) {
    super(message, options)
    this.jobId = job.jobId
    this.jobStatus = job.status
    this.lastEventId = job.lastEventId
  }
}

/** A pre-stream refusal: `{"error": {"code", "message", "retryable", "field"?}}` with its HTTP status. */
export class HttpError extends StreamgateError {
  override readonly name = 'HttpError'
  /** The HTTP status: 400, 404, 413, 422, 429, 503… */
  readonly status: number
  /** The protocol's error code; undefined when the body was not the protocol's JSON (a proxy's page). */
  readonly code: Code | undefined
  readonly retryable: boolean
  /** The parameter at fault, as a path (`prompts[3]`, `max_tokens`), when there is one. */
  readonly field: string | undefined
  /** Seconds to wait, from `Retry-After` (delta-seconds or an HTTP date); undefined without one. */
  readonly retryAfter: number | undefined
  /** The parsed JSON body, or the body's text when it was not JSON. */
  readonly body: unknown

  constructor(
    status: number,
    info: Partial<ErrorInfo> & {message: string},
    extra: {retryAfter?: number | undefined; body?: unknown; job?: JobSnapshot | undefined} = {},
  ) {
    super(info.message, extra.job ?? {})
    this.status = status
    this.code = info.code
    this.retryable = info.retryable ?? (status === 429 || status === 503)
    this.field = info.field ?? undefined
    this.retryAfter = extra.retryAfter
    this.body = extra.body
  }

  /**
   * Read a non-2xx response: its JSON error body when it has one, and `Retry-After`. `job` is
   * the job the request was about, for a refused reconnect.
   */
  static async fromResponse(response: Response, now: number = Date.now(), job: JobSnapshot = {}): Promise<HttpError> {
    let text = ''
    try {
      text = await response.text()
    } catch {
      // The body could not be read: the status alone must do.
    }
    let body: unknown = text
    try {
      body = JSON.parse(text)
    } catch {
      // Not JSON: keep the text.
    }
    const retryAfter = parseRetryAfter(response.headers.get('Retry-After'), now)
    const info = isErrorBody(body) ? body.error : undefined
    if (info) return new HttpError(response.status, info, {retryAfter, body, job})
    const message = `HTTP ${response.status}${response.statusText ? ` ${response.statusText}` : ''}${
      text ? `: ${text.slice(0, 200)}` : ''
    }`
    return new HttpError(response.status, {message}, {retryAfter, body, job})
  }
}

/** The job's terminal `error` event. */
export class JobError extends StreamgateError {
  override readonly name = 'JobError'
  readonly code: Code
  readonly retryable: boolean

  constructor(info: ErrorInfo, job: JobSnapshot) {
    super(info.message, job)
    this.code = info.code
    this.retryable = info.retryable
  }
}

/**
 * The stream ended before its terminal event: the connection broke, the server went away, or it
 * could not be reached at all (then `jobId` is undefined). The job may or may not have finished.
 */
export class StreamEndedError extends StreamgateError {
  override readonly name = 'StreamEndedError'
}

/** The caller's `signal` aborted the run; `cause` is the signal's reason. */
export class AbortError extends StreamgateError {
  override readonly name = 'AbortError'
}

/** `timeoutMs` passed before the job ended; the run was aborted and the job cancelled. */
export class TimeoutError extends StreamgateError {
  override readonly name = 'TimeoutError'
  readonly timeoutMs: number

  constructor(timeoutMs: number, job: JobSnapshot) {
    super(`no result within ${timeoutMs} ms`, job)
    this.timeoutMs = timeoutMs
  }
}

/** The gateway answered something that is not the protocol: not an event stream, or a frame that is not JSON. */
export class ProtocolError extends StreamgateError {
  override readonly name = 'ProtocolError'
}

/** `Retry-After` as seconds from `now`: delta-seconds or an HTTP date; undefined if absent or unreadable. */
export function parseRetryAfter(value: string | null, now: number = Date.now()): number | undefined {
  if (value === null) return undefined
  const text = value.trim()
  if (/^\d+$/.test(text)) return Number(text)
  const date = Date.parse(text)
  if (Number.isNaN(date)) return undefined
  return Math.max(0, Math.ceil((date - now) / 1000))
}

function isErrorBody(body: unknown): body is {error: ErrorInfo} {
  if (typeof body !== 'object' || body === null || !('error' in body)) return false
  const error = (body as {error: unknown}).error
  return (
    typeof error === 'object' &&
    error !== null &&
    typeof (error as ErrorInfo).message === 'string' &&
    typeof (error as ErrorInfo).code === 'string'
  )
}
