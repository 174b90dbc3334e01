/** Running runAndStream in tests: what the callbacks saw, checked against a fixture's expectations. */
import assert from 'node:assert/strict'

import {JobError, runAndStream, type ResumeInfo, type RunError, type RunOptions} from '../../src/index.ts'
import {JOB, type Expected} from '../fixtures.ts'

export interface Seen {
  result?: unknown
  error?: unknown
  statuses: string[]
  logs: {message: string; status: string | undefined}[]
  partials: unknown[]
  resumes: ResumeInfo[]
}

/** Run against `fetch`, recording every callback; never throws (the error is in `seen.error`). */
export async function play(url: string, fetch: typeof globalThis.fetch, options: RunOptions = {}): Promise<Seen> {
  const seen: Seen = {statuses: [], logs: [], partials: [], resumes: []}
  try {
    seen.result = await runAndStream(url, {prompts: ['x']}, {
      fetch,
      onStatus: (frame) => seen.statuses.push(frame.status),
      onLog: (frame, job) => seen.logs.push({message: frame.message, status: job.status}),
      onPartial: (partial) => seen.partials.push(partial),
      onResume: (info) => seen.resumes.push(info),
      ...options,
    })
  } catch (error) {
    seen.error = error
  }
  return seen
}

/** What was seen is what the fixture expects: the result or the JobError, and every callback in order. */
export function check(seen: Seen, expected: Expected, where: string): void {
  if (expected.error) {
    assert.ok(seen.error instanceof JobError, `${where}: expected a JobError, got ${String(seen.error)}`)
    assert.equal(seen.error.code, expected.error.code, where)
    assert.equal(seen.error.message, expected.error.message, where)
    assert.equal(seen.error.retryable, expected.error.retryable, where)
    assert.equal(seen.error.jobId, JOB, where)
  } else {
    assert.equal(seen.error, undefined, `${where}: ${String(seen.error)}`)
    assert.deepEqual(seen.result, expected.result, where)
  }
  assert.deepEqual(seen.statuses, expected.statuses, where)
  assert.deepEqual(seen.logs, expected.logs, where)
  assert.deepEqual(seen.partials, expected.partials, where)
}

/** The error a run rejects with; fails the test if it resolves. */
export async function failure(promise: Promise<unknown>): Promise<RunError> {
  try {
    await promise
  } catch (error) {
    return error as RunError
  }
  assert.fail('expected the run to fail')
}

/** Long enough for a fire-and-forget DELETE to be sent. */
export const settle = () => new Promise((resolve) => setTimeout(resolve, 10))
