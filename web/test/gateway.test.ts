/** runAndStream against a real gateway (`streamgate serve` on the tiny model), started by the test. */
import assert from 'node:assert/strict'
import {after, before, describe, test} from 'node:test'

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
  type ToolInfo,
} from '../src/index.ts'
import {startGateway, type Gateway} from './support/gateway.ts'

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

  test('every built-in tool runs with its example params', async () => {
    const tools = (await (await fetch(`${gateway.url}/tools`)).json()) as ToolInfo[]
    const names = Object.keys(EXAMPLES) as (keyof BuiltinTools)[]
    assert.deepEqual(tools.map((t) => t.name).sort(), [...names].sort())
    for (const name of names) {
      const statuses: string[] = []
      const result = await runTool(gateway.url, name, EXAMPLES[name], {onStatus: (frame) => statuses.push(frame.status)})
      assert.equal(typeof result, 'object', name)
      assert.equal(statuses.at(-1), 'RUNNING', name)
    }
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
})
