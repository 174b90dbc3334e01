/** runAndStream over fixture streams, cut at every byte boundary and framed every way. */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {JobError, runAndStream, StreamEndedError} from '../src/index.ts'
import {cuts, fakeFetch} from './support/fake.ts'
import {FIXTURES, JOB, TRUNCATED, VARIANTS, type Expected} from './fixtures.ts'

const URL_ = 'http://gateway.test/generate/run'
const encoder = new TextEncoder()

interface Seen {
  result?: unknown
  error?: unknown
  statuses: string[]
  logs: {message: string; status: string | undefined}[]
  partials: unknown[]
}

async function play(chunks: (Uint8Array | string)[]): Promise<Seen> {
  const {fetch} = fakeFetch(() => ({chunks, headers: {'Content-Type': 'text/event-stream; charset=utf-8', 'X-Job-Id': JOB}}))
  const seen: Seen = {statuses: [], logs: [], partials: []}
  try {
    seen.result = await runAndStream(URL_, {prompts: ['x']}, {
      fetch,
      onStatus: (frame) => seen.statuses.push(frame.status),
      onLog: (frame, job) => seen.logs.push({message: frame.message, status: job.status}),
      onPartial: (partial) => seen.partials.push(partial),
    })
  } catch (error) {
    seen.error = error
  }
  return seen
}

function check(seen: Seen, expected: Expected, where: string): void {
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

for (const fixture of FIXTURES) {
  describe(fixture.name, () => {
    for (const variant of VARIANTS) {
      test(`${variant.name}, in one chunk, cut at every byte, and byte by byte`, async () => {
        const bytes = encoder.encode(variant.transform(fixture.stream))
        check(await play([bytes]), fixture.expected, 'one chunk')
        for (const {name, chunks} of cuts(bytes)) {
          check(await play(chunks), fixture.expected, name)
        }
      })
    }
  })
}

describe('streams that end without a terminal event', () => {
  for (const {name, stream} of TRUNCATED) {
    test(`${name}: StreamEndedError, framed every way, cut anywhere`, async () => {
      for (const variant of VARIANTS) {
        const bytes = encoder.encode(variant.transform(stream))
        for (const {name: cut, chunks} of [{name: 'whole', chunks: [bytes]}, ...cuts(bytes)]) {
          const seen = await play(chunks)
          const where = `${variant.name}, ${cut}`
          assert.ok(seen.error instanceof StreamEndedError, `${where}: ${String(seen.error)}`)
          if (stream) assert.equal(seen.error.jobId, JOB, where)
          assert.equal(seen.result, undefined, where)
        }
      }
    })
  }

  test('the last status and event id are on the error', async () => {
    const seen = await play([TRUNCATED[0]!.stream])
    assert.ok(seen.error instanceof StreamEndedError)
    assert.equal(seen.error.jobStatus, 'RUNNING')
    assert.equal(seen.error.lastEventId, `${JOB}:3`)
  })
})
