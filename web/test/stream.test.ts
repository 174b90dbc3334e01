/**
 * runAndStream over fixture streams, cut at every byte boundary and framed every way. Resuming
 * is off here: these are about reading one stream (resume.test.ts resumes them).
 */
import assert from 'node:assert/strict'
import {describe, test} from 'node:test'

import {StreamEndedError} from '../src/index.ts'
import {cuts, fakeFetch} from './support/fake.ts'
import {FIXTURES, JOB, TRUNCATED, VARIANTS} from './fixtures.ts'
import {check, play, type Seen} from './support/play.ts'

const URL_ = 'http://gateway.test/generate/run'
const encoder = new TextEncoder()

/** One run of `chunks` as the POST's answer, resuming off. */
function playChunks(chunks: (Uint8Array | string)[]): Promise<Seen> {
  const {fetch} = fakeFetch(() => ({chunks, headers: {'Content-Type': 'text/event-stream; charset=utf-8', 'X-Job-Id': JOB}}))
  return play(URL_, fetch, {resume: false})
}

for (const fixture of FIXTURES) {
  describe(fixture.name, () => {
    for (const variant of VARIANTS) {
      test(`${variant.name}, in one chunk, cut at every byte, and byte by byte`, async () => {
        const bytes = encoder.encode(variant.transform(fixture.stream))
        check(await playChunks([bytes]), fixture.expected, 'one chunk')
        for (const {name, chunks} of cuts(bytes)) {
          check(await playChunks(chunks), fixture.expected, name)
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
          const seen = await playChunks(chunks)
          const where = `${variant.name}, ${cut}`
          assert.ok(seen.error instanceof StreamEndedError, `${where}: ${String(seen.error)}`)
          if (stream) assert.equal(seen.error.jobId, JOB, where)
          assert.equal(seen.result, undefined, where)
        }
      }
    })
  }

  test('the last status and event id are on the error', async () => {
    const seen = await playChunks([TRUNCATED[0]!.stream])
    assert.ok(seen.error instanceof StreamEndedError)
    assert.equal(seen.error.jobStatus, 'RUNNING')
    assert.equal(seen.error.lastEventId, `${JOB}:3`)
  })
})
