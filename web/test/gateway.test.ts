/** runAndStream against a real gateway (`streamgate serve` on the tiny model), started by the test. */
import assert from 'node:assert/strict'
import {createServer} from 'node:http'
import type {AddressInfo} from 'node:net'
import {after, before, describe, test} from 'node:test'

import {Webhook} from 'standardwebhooks'

import {
  AbortError,
  EXAMPLES,
  HttpError,
  runAndStream,
  runTool,
  TimeoutError,
  type BuiltinTools,
  type GeneratePartial,
  type GenerateResult,
  type StatusFrame,
  type ToolInfo,
} from '../src/index.ts'
import {startGateway, type Gateway} from './support/gateway.ts'
import {startProxy, type CutAt} from './support/proxy.ts'

let gateway: Gateway

before(async () => {
  gateway = await startGateway()
})

after(async () => {
  await gateway?.stop()
})

async function idle(): Promise<void> {
  // The worker is free again once nothing runs (a cancelled job stops at its next step).
  for (let i = 0; i < 100; i++) {
    const ready = (await (await fetch(`${gateway.url}/readyz`)).json()) as {running: number; queued: number}
    if (ready.running === 0 && ready.queued === 0) return
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
  assert.fail('the gateway still has jobs running')
}

describe('against a real gateway', () => {
  test('generate: statuses in order, tokens as they stream, then the result', async () => {
    const statuses: string[] = []
    const partials: GeneratePartial[] = []
    const result = await runAndStream<GenerateResult, GeneratePartial>(
      `${gateway.url}/generate/run`,
      {prompts: ['Hello there'], max_tokens: 12},
      {
        onStatus: (frame) => statuses.push(frame.status),
        onPartial: (partial) => partials.push(partial),
        headers: {Authorization: 'Bearer not-checked-yet'},
      },
    )
    assert.deepEqual([...new Set(statuses)], ['RECEIVED', 'QUEUED', 'RUNNING'])
    assert.equal(result.usage.completion_tokens, 12)
    assert.ok(partials.length >= 2, `only ${partials.length} partials`)
    assert.equal(partials.map((p) => p.text).join(''), result.completions[0])
  })

  test('every built-in tool runs with its example params; one the model cannot run is refused with its reason', async () => {
    const tools = (await (await fetch(`${gateway.url}/tools`)).json()) as ToolInfo[]
    const names = Object.keys(EXAMPLES) as (keyof BuiltinTools)[]
    assert.deepEqual(tools.map((t) => t.name).sort(), [...names].sort())
    for (const name of names) {
      const unsupported = tools.find((t) => t.name === name)!.unsupported
      const statuses: string[] = []
      const run = runTool(gateway.url, name, EXAMPLES[name], {onStatus: (frame) => statuses.push(frame.status)})
      if (unsupported) {
        // Refused before it is queued: no stream, no status.
        const error = await run.catch((e: unknown) => e)
        assert.ok(error instanceof HttpError, `${name}: ${String(error)}`)
        assert.equal(error.status, 422, name)
        assert.equal(error.code, 'unsupported_by_model', name)
        assert.equal(error.message, unsupported, name)
        assert.equal(error.retryable, false, name)
        assert.deepEqual(statuses, [], name)
        continue
      }
      const result = await run
      assert.equal(typeof result, 'object', name)
      assert.equal(statuses.at(-1), 'RUNNING', name)
    }
    // The tiny Llama is a causal LM: the masked-LM tools are the ones it cannot run.
    assert.deepEqual(tools.filter((t) => t.unsupported).map((t) => t.name), ['fill_mask', 'pseudo_loglikelihood'])
  })

  test('logit_lens: a layer × position × k grid', async () => {
    const result = await runTool(gateway.url, 'logit_lens', {prompt: 'abc', top_k: 3})
    assert.equal(result.tokens.length, 4) // <s> a b c
    assert.equal(result.topk.length, result.layers.length)
    assert.equal(result.topk[0]!.length, result.positions.length)
    assert.equal(result.topk[0]![0]!.length, 3)
  })

  test('an invalid field: HttpError 422 naming it', async () => {
    const error = await runTool(gateway.url, 'generate', {prompts: ['x'], max_tokens: 0}).catch((e: unknown) => e)
    assert.ok(error instanceof HttpError)
    assert.equal(error.status, 422)
    assert.equal(error.code, 'invalid_params')
    assert.equal(error.field, 'max_tokens')
    assert.equal(error.message, 'max_tokens: expected `int` >= 1')
  })

  test('an unknown tool: HttpError 404 unknown_tool', async () => {
    const error = await runAndStream(`${gateway.url}/nope/run`, {}).catch((e: unknown) => e)
    assert.ok(error instanceof HttpError)
    assert.equal(error.status, 404)
    assert.equal(error.code, 'unknown_tool')
  })

  test('aborting a running job: AbortError, and the worker is freed', async () => {
    const controller = new AbortController()
    let tokens = 0
    const run = runTool(gateway.url, 'generate', {prompts: ['Once upon a time'], max_tokens: 200}, {
      signal: controller.signal,
      onPartial: () => {
        tokens += 1
        if (tokens === 3) controller.abort()
      },
    })
    const error = await run.catch((e: unknown) => e)
    assert.ok(error instanceof AbortError, String(error))
    assert.match(error.jobId ?? '', /^[0-9a-f]{32}$/)
    assert.equal(error.jobStatus, 'RUNNING')
    await idle()
    // The gateway goes on serving.
    const next = await runTool(gateway.url, 'predict', {prompt: 'x', top_k: 2})
    assert.equal(next.predictions.length, 2)
  })

  test('timeoutMs: TimeoutError, and the job is cancelled', async () => {
    const error = await runTool(gateway.url, 'generate', {prompts: ['Once upon a time'], max_tokens: 200}, {timeoutMs: 30}).catch(
      (e: unknown) => e,
    )
    assert.ok(error instanceof TimeoutError, String(error))
    await idle()
  })

  test('a connection cut at any point resumes the same job: the result of an uninterrupted run, each event once', async () => {
    const proxy = await startProxy(gateway.url)
    const params = {prompts: ['Once upon a time'], max_tokens: 24, seed: 7}
    type Run = {result: GenerateResult; text: string; statuses: StatusFrame[]; resumes: number}
    const run = async (): Promise<Run> => {
      const seen: Run = {result: undefined as unknown as GenerateResult, text: '', statuses: [], resumes: 0}
      seen.result = await runTool(proxy.url, 'generate', params, {
        onStatus: (frame) => seen.statuses.push(frame),
        onPartial: (partial) => (seen.text += partial.text),
        onResume: () => (seen.resumes += 1),
        resume: {delayMs: 10},
      })
      // Close the kept-alive connection, so that the next run opens a new one (the one a cut applies to).
      proxy.drop()
      await new Promise((resolve) => setTimeout(resolve, 20))
      return seen
    }
    try {
      const whole = await run()
      assert.equal(whole.resumes, 0)
      const length = proxy.answered.at(-1)!
      const cuts: CutAt[] = [
        0, // before any answer: the POST is sent again
        20, // inside the headers
        {before: 'event: status'}, // before RECEIVED
        {before: '"QUEUED"'}, // while queued
        {before: 'event: partial', plus: 20}, // inside the first token
        Math.round(0.5 * length), // mid-generation
        {before: /id: \w+:\d+\nevent: data/}, // between the last partial and the terminal
        {before: 'event: data', plus: 20}, // inside the terminal
      ]
      for (const cut of cuts) {
        const answered = proxy.cutNext(cut)
        const seen = await run()
        const where = `cut at ${String(typeof cut === 'number' ? cut : cut.before)} (of ${length} bytes)`
        assert.ok(seen.resumes >= 1, where)
        assert.deepEqual(seen.result, whole.result, where)
        assert.equal(seen.text, whole.result.completions[0], `${where}: every token once`)
        const seqs = seen.statuses.map((frame) => frame.seq)
        assert.deepEqual(seqs, [...new Set(seqs)].sort((a, b) => a - b), `${where}: statuses once, in order`)
        assert.deepEqual([...new Set(seen.statuses.map((f) => f.status))], ['RECEIVED', 'QUEUED', 'RUNNING'], where)
        // The job the cut connection started is the one that finished: a POST sent again attached to it.
        const started = /x-job-id: ([0-9a-f]+)/i.exec(await answered)?.[1]
        assert.ok(started, `${where}: the gateway answered no job id`)
        assert.ok(seen.statuses.every((frame) => frame.job_id === started), where)
      }
      await idle()
    } finally {
      await proxy.close()
    }
  })
})

describe('a run naming a callback', () => {
  test("the gateway POSTs the job's end to callbackUrl, verified by the standardwebhooks package", async () => {
    const secret = 'whsec_' + Buffer.from('a webhook secret of 32 bytes....').toString('base64')
    const received: {headers: Record<string, string>; body: string}[] = []
    const receiver = createServer((request, response) => {
      const chunks: Buffer[] = []
      request.on('data', (chunk: Buffer) => chunks.push(chunk))
      request.on('end', () => {
        received.push({headers: request.headers as Record<string, string>, body: Buffer.concat(chunks).toString()})
        response.writeHead(204).end()
      })
    })
    await new Promise<void>((resolve) => receiver.listen(0, '127.0.0.1', resolve))
    const port = (receiver.address() as AddressInfo).port
    const hooked = await startGateway(['--webhook-secret', secret, '--callback-hosts', '127.0.0.1', '--detach-grace', '30'])
    try {
      const callbackUrl = `http://127.0.0.1:${port}/hooks`
      const result = await runAndStream<GenerateResult>(`${hooked.url}/generate/run`, {prompts: ['Hi'], max_tokens: 3}, {callbackUrl})
      for (let i = 0; i < 200 && received.length === 0; i++) await new Promise((resolve) => setTimeout(resolve, 50))
      assert.equal(received.length, 1)
      const message = new Webhook(secret).verify(received[0]!.body, received[0]!.headers) as {type: string; data: {result: unknown}}
      assert.equal(message.type, 'job.succeeded')
      assert.deepEqual(message.data.result, result)
      // One the gateway may not deliver to is refused before the job starts.
      const refused = await runAndStream(`${hooked.url}/generate/run`, {prompts: ['Hi'], max_tokens: 3}, {callbackUrl: 'http://10.0.0.1/hooks'}).catch((e: unknown) => e)
      assert.ok(refused instanceof HttpError && refused.status === 403, String(refused))
    } finally {
      await hooked.stop()
      receiver.close()
    }
  })
})
