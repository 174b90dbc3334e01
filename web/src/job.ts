/**
 * A job as its events tell it: the one place that reads the protocol's events,
 * used by `runAndStream` (fed by eventsource-parser) and by the dashboard (fed by
 * the browser's `EventSource`).
 *
 * Rules it keeps: only `status` events change the status (a `log` never does);
 * unknown event types are ignored; nothing after the terminal event counts; an
 * event whose `seq` is not past the last one seen is a replay (a reconnect that
 * lost its `Last-Event-ID` on the way) and counts once.
 */
import {ProtocolError} from './errors.ts'
import type {ErrorInfo, LogFrame, Progress, Status, StatusFrame} from './generated/types.ts'

/** One decoded event of a job's stream. `partial` and `data` are per tool. */
export type JobEvent<R = unknown, P = unknown> =
  | {type: 'status'; frame: StatusFrame}
  | {type: 'log'; frame: LogFrame}
  | {type: 'partial'; partial: P}
  | {type: 'data'; result: R}
  | {type: 'error'; error: ErrorInfo}

/** A raw SSE message, as eventsource-parser and `EventSource` both give it. */
export interface RawEvent {
  event?: string | undefined
  data: string
  id?: string | undefined
}

export interface JobState<R = unknown> {
  jobId: string | undefined
  /** The last `id:` seen, `<job_id>:<seq>`. */
  lastEventId: string | undefined
  status: Status | undefined
  /** 1 = next to run; set while QUEUED. */
  position: number | undefined
  queueSize: number | undefined
  etaS: number | undefined
  progress: Progress | undefined
  /** Each change of status or queue position, in order (progress-only frames are not repeated here). */
  timeline: StatusFrame[]
  logs: LogFrame[]
  partials: number
  /** True after the terminal event: then exactly one of `result` and `error` is set. */
  done: boolean
  result: R | undefined
  error: ErrorInfo | undefined
}

const EVENTS = new Set(['status', 'log', 'partial', 'data', 'error'])

/** `<job_id>:<seq>` split; undefined when the id is not of that form. */
export function parseEventId(id: string | undefined): {jobId: string; seq: number} | undefined {
  const match = id ? /^(.+):(\d+)$/.exec(id.trim()) : null
  return match ? {jobId: match[1]!, seq: Number(match[2])} : undefined
}

export class JobTracker<R = unknown, P = unknown> {
  readonly state: JobState<R> = {
    jobId: undefined,
    lastEventId: undefined,
    status: undefined,
    position: undefined,
    queueSize: undefined,
    etaS: undefined,
    progress: undefined,
    timeline: [],
    logs: [],
    partials: 0,
    done: false,
    result: undefined,
    error: undefined,
  }

  private lastSeq = 0

  /** Keep the logs (they can be many); off for `runAndStream`, which hands each to a callback. */
  constructor(private readonly keepLogs = true) {}

  /**
   * Read one message: update the state and return the decoded event, or undefined for what
   * does not count (an unknown event type, a replayed event, anything after the terminal event).
   * Throws `ProtocolError` when a known event's data is not JSON.
   */
  observe(message: RawEvent): JobEvent<R, P> | undefined {
    const state = this.state
    const type = message.event ?? 'message'
    if (state.done || !EVENTS.has(type)) return undefined
    const id = parseEventId(message.id)
    if (id && id.jobId === (state.jobId ?? id.jobId)) {
      if (id.seq <= this.lastSeq) return undefined
      this.lastSeq = id.seq
    }
    let data: unknown
    try {
      data = JSON.parse(message.data)
    } catch {
      throw new ProtocolError(`a ${type} event whose data is not JSON: ${message.data.slice(0, 120)}`, this.snapshot())
    }
    if (id) {
      state.lastEventId = message.id
      state.jobId ??= id.jobId
    }
    switch (type) {
      case 'status': {
        const frame = data as StatusFrame
        state.jobId ??= frame.job_id
        const last = state.timeline.at(-1)
        if (!last || last.status !== frame.status || (frame.position ?? undefined) !== (last.position ?? undefined)) {
          state.timeline.push(frame)
        }
        state.status = frame.status
        state.position = frame.status === 'QUEUED' ? (frame.position ?? undefined) : undefined
        state.queueSize = frame.status === 'QUEUED' ? (frame.queue_size ?? undefined) : undefined
        state.etaS = frame.eta_s ?? undefined
        if (frame.progress) state.progress = frame.progress
        return {type, frame}
      }
      case 'log': {
        const frame = data as LogFrame
        if (this.keepLogs) state.logs.push(frame)
        return {type, frame}
      }
      case 'partial':
        state.partials += 1
        return {type, partial: data as P}
      case 'data':
        state.done = true
        state.result = data as R
        return {type, result: data as R}
      default: {
        const frame = data as {error?: ErrorInfo}
        const error: ErrorInfo = frame.error ?? {code: 'internal', message: 'an error event without an error', retryable: false}
        state.done = true
        state.error = error
        return {type: 'error', error}
      }
    }
  }

  snapshot(): {jobId: string | undefined; status: Status | undefined; lastEventId: string | undefined} {
    return {jobId: this.state.jobId, status: this.state.status, lastEventId: this.state.lastEventId}
  }
}
