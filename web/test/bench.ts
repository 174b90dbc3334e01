/**
 * How fast runAndStream reads a stream: a `generate`-like job of many partial events,
 * fed in chunks of several sizes through an in-memory fetch. `npm run bench`.
 */
import {runAndStream} from '../src/index.ts'
import {fakeFetch} from './support/fake.ts'

const JOB = '0123456789abcdef0123456789abcdef'
const EVENTS = 20_000
let stream = 'retry: 3000\n\n'
let seq = 0
const frame = (type: string, data: string) => `id: ${JOB}:${++seq}\nevent: ${type}\ndata: ${data}\n\n`
stream += frame('status', `{"job_id":"${JOB}","seq":1,"status":"RUNNING","ts":1}`)
for (let i = 0; i < EVENTS; i++) {
  stream += frame('partial', `{"index":0,"text":" tok${i} é","token_ids":[${i}]}`)
  if (i % 10 === 0) stream += frame('status', `{"job_id":"${JOB}","seq":${seq + 1},"status":"RUNNING","ts":2,"progress":{"done":${i},"total":${EVENTS},"unit":"tokens"}}`)
}
stream += frame('data', '{"completions":["…"]}')
const bytes = new TextEncoder().encode(stream)

console.log(`${(bytes.length / 1e6).toFixed(2)} MB, ${seq} events`)
for (const size of [64, 1024, 16_384, 262_144]) {
  const chunks: Uint8Array[] = []
  for (let i = 0; i < bytes.length; i += size) chunks.push(bytes.subarray(i, i + size))
  const best: number[] = []
  for (let round = 0; round < 5; round++) {
    const {fetch} = fakeFetch(() => ({chunks, headers: {'Content-Type': 'text/event-stream'}}))
    let partials = 0
    const start = performance.now()
    await runAndStream('http://bench.test/generate/run', {}, {fetch, onPartial: () => partials++})
    best.push(performance.now() - start)
    if (partials !== EVENTS) throw new Error(`read ${partials} partials of ${EVENTS}`)
  }
  const ms = Math.min(...best)
  console.log(
    `chunks of ${String(size).padStart(6)} B: ${ms.toFixed(1).padStart(7)} ms  ${((bytes.length / 1e6 / ms) * 1000).toFixed(1).padStart(6)} MB/s  ${Math.round((seq / ms) * 1000).toLocaleString('en').padStart(9)} events/s`,
  )
}
