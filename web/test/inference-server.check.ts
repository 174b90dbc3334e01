/**
 * The TypeScript client and the dashboard on a model served by an inference server (vLLM), against
 * a running gateway: `STREAMGATE_GATEWAY_URL`, serving `STREAMGATE_MODEL` through a vLLM server
 * (`--model NAME=vllm:` or `openai+http://…/v1`). `runTool` streams `generate` on it (statuses,
 * partials that add up to the result, one terminal event) and gets what the server itself answers
 * to the same greedy request; aborting a run cancels the job, and a stream cut mid-job is resumed
 * to the same result; a tool the model cannot run is refused with the typed 422. The dashboard, in
 * headless Chromium, lists the model's tools (and the ones it cannot run, with why), runs
 * `generate` on it and shows the completion the gateway recorded. Screenshots go to test-artifacts/.
 *
 * Not part of `npm test` (no inference server there): tests/test_inference_server_web.py runs it
 * against the Python test suite's vLLM gateway.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {createParser, type EventSourceMessage} from 'eventsource-parser'
import {type BrowserContext, type Page} from 'playwright-core'

import {
  AbortError,
  EXAMPLES,
  HttpError,
  JobTracker,
  listModels,
  parseEventId,
  runTool,
  StreamEndedError,
  type GenerateParams,
  type GeneratePartial,
  type GenerateResult,
  type ModelInfo,
  type ModelList,
  type ResumeInfo,
  type ToolInfo,
} from '../src/index.ts'
import type {JobSnapshot} from '../src/generated/types.ts'
import {ARTIFACTS, finished, launch, rawResult, run} from './support/browser.ts'

function required(name: string): string {
  const value = process.env[name]
  if (!value) {
    throw new Error(
      `${name} is not set: this file runs against a gateway serving a model on an inference server ` +
        '(STREAMGATE_GATEWAY_URL, its URL; STREAMGATE_MODEL, the model): tests/test_inference_server_web.py runs it',
    )
  }
  return value
}

const GATEWAY = required('STREAMGATE_GATEWAY_URL').replace(/\/+$/, '')
const MODEL = required('STREAMGATE_MODEL')

const PROMPTS = ['Hello, my name is', 'The capital of France is']
/** A prompt the model goes on from for all of `max_tokens` 400 (checked against the server's own answer). */
const LONG_PROMPT = 'Once upon a time'

let models: ModelList
let model: ModelInfo
/** `GET /tools?model=MODEL`. */
let tools: ToolInfo[]
/** The inference server's `/v1` URL, and the name it serves the model under. */
let server: {url: string; model: string}

async function getJson<T>(url: string, init?: RequestInit): Promise<T> {
  const response = await fetch(url, init)
  const text = await response.text()
  assert.ok(response.ok, `${init?.method ?? 'GET'} ${url} answered ${response.status}: ${text.slice(0, 300)}`)
  return JSON.parse(text) as T
}

/** What the inference server answers to a greedy `/completions` request, without the gateway. */
async function direct(prompt: string[], maxTokens: number) {
  const answer = await getJson<{choices: {index: number; text: string; finish_reason: string}[]; usage: Record<string, number>}>(
    `${server.url}/completions`,
    {
      method: 'POST',
      headers: {'Content-Type': 'application/json'},
      body: JSON.stringify({model: server.model, prompt, max_tokens: maxTokens, temperature: 0}),
    },
  )
  return {...answer, choices: [...answer.choices].sort((a, b) => a.index - b.index)}
}

const job = (id: string) => getJson<JobSnapshot>(`${GATEWAY}/jobs/${id}`)

/** The job's snapshot once it has ended. */
async function ended(id: string): Promise<JobSnapshot> {
  const deadline = Date.now() + 120_000
  for (;;) {
    const snapshot = await job(id)
    if (snapshot.terminal) return snapshot
    if (Date.now() > deadline) assert.fail(`job ${id} has not ended: ${JSON.stringify(snapshot)}`)
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
}

/** Every SSE event of a finished stream's text, in order. */
function parseEvents(text: string): EventSourceMessage[] {
  const events: EventSourceMessage[] = []
  const parser = createParser({onEvent: (event) => events.push(event)})
  parser.feed(text)
  return events
}

const terminals = (events: EventSourceMessage[]) => events.filter((e) => e.event === 'data' || e.event === 'error')

/** The partials' texts, joined per prompt. */
function joined(partials: GeneratePartial[], count: number): string[] {
  const texts = Array.from({length: count}, () => '')
  for (const p of partials) texts[p.index] += p.text
  return texts
}

function assertPartialShape(partials: GeneratePartial[], count: number): void {
  assert.ok(partials.length > 0, 'no partial event')
  for (const p of partials) {
    assert.ok(Number.isInteger(p.index) && p.index >= 0 && p.index < count, `a partial's index: ${JSON.stringify(p)}`)
    assert.equal(typeof p.text, 'string')
    // The chunk's token ids where the server gives them, [] where it does not.
    assert.ok(Array.isArray(p.token_ids) && p.token_ids.every((t) => Number.isInteger(t)), `a partial's token_ids: ${JSON.stringify(p)}`)
  }
}

before(async () => {
  models = await listModels(GATEWAY)
  const found = models.models.find((m) => m.name === MODEL)
  assert.ok(found, `the gateway does not serve ${MODEL}: ${models.models.map((m) => m.name).join(', ')}`)
  model = found
  assert.equal(model.ready, true, `${MODEL} is not ready: ${model.problem}`)
  assert.equal(model.kind, 'causal_lm')
  assert.match(model.device ?? '', / server$/, `${MODEL} is not served by an inference server: its device is ${model.device}`)
  tools = await getJson<ToolInfo[]>(`${GATEWAY}/tools?model=${encodeURIComponent(MODEL)}`)
  // The server: `/readyz`'s entry for the model, an engine the gateway started (vllm:) or a server it fronts (openai+).
  const ready = await getJson<{engines?: {model: string; url?: string}[]; servers?: {model: string; url?: string}[]}>(`${GATEWAY}/readyz`)
  const entry = [...(ready.engines ?? []), ...(ready.servers ?? [])].find((e) => e.model === MODEL && typeof e.url === 'string')
  assert.ok(entry?.url, `/readyz names no server for ${MODEL}: ${JSON.stringify(ready)}`)
  const url = entry.url.replace(/\/+$/, '')
  const served = await getJson<{data: {id: string}[]}>(`${url}/models`)
  server = {url, model: served.data[0]!.id}
})

describe('the TypeScript client on a model served by vLLM', () => {
  test('generate streams statuses and partials that add up to the result, which is the server’s own answer', async () => {
    const statuses: string[] = []
    const partials: GeneratePartial[] = []
    let jobId: string | undefined
    // The stream the client reads, kept whole to count its terminal events.
    const streams: Promise<string>[] = []
    const recording: typeof fetch = async (input, init) => {
      const response = await fetch(input, init)
      if (!response.body || !response.headers.get('Content-Type')?.startsWith('text/event-stream')) return response
      const [mine, theirs] = response.body.tee()
      streams.push(new Response(mine).text())
      return new Response(theirs, {status: response.status, statusText: response.statusText, headers: response.headers})
    }
    const params: GenerateParams = {prompts: PROMPTS, max_tokens: 8, temperature: 0}
    const result: GenerateResult = await runTool(GATEWAY, 'generate', params, {
      model: MODEL,
      fetch: recording,
      onStatus: (frame, state) => {
        statuses.push(frame.status)
        jobId = state.jobId
      },
      onPartial: (partial) => partials.push(partial),
    })
    assert.equal(statuses[0], 'RECEIVED')
    assert.ok(statuses.includes('RUNNING'), `statuses: ${statuses.join(', ')}`)
    assert.match(jobId ?? '', /^[0-9a-f]{32}$/)

    assert.equal(result.completions.length, PROMPTS.length)
    assertPartialShape(partials, PROMPTS.length)
    assert.deepEqual(joined(partials, PROMPTS.length), result.completions)
    for (const [i, text] of result.completions.entries()) assert.ok(text.length > 0, `completion ${i} is empty`)

    // The inference server's own answer to the same request.
    const own = await direct(PROMPTS, 8)
    assert.deepEqual(result.completions, own.choices.map((c) => c.text))
    assert.deepEqual(result.finish_reasons, own.choices.map((c) => c.finish_reason))
    assert.deepEqual(result.usage, {prompt_tokens: own.usage.prompt_tokens, completion_tokens: own.usage.completion_tokens, total_tokens: own.usage.total_tokens})

    // One stream, ending with exactly one terminal event: the result.
    assert.equal(streams.length, 1)
    const events = parseEvents(await streams[0]!)
    assert.equal(terminals(events).length, 1)
    assert.equal(events.at(-1)!.event, 'data')
    assert.deepEqual(JSON.parse(events.at(-1)!.data), result)
    assert.equal(events.filter((e) => e.event === 'partial').length, partials.length)

    // The gateway's record of the job.
    const snapshot = await job(jobId!)
    assert.equal(snapshot.status, 'SUCCEEDED')
    assert.equal(snapshot.model, MODEL)
    assert.deepEqual(snapshot.terminal, {event: 'data', data: result})
  })

  test('aborting a long generation cancels its job; the job’s events, followed again by id, end with that one terminal', async () => {
    const own = await direct([LONG_PROMPT], 400)
    assert.equal(own.choices[0]!.finish_reason, 'length', 'the server stops before 400 tokens: a cancel could come too late')
    const whole = own.choices[0]!.text

    const controller = new AbortController()
    const partials: GeneratePartial[] = []
    const failure = await runTool(GATEWAY, 'generate', {prompts: [LONG_PROMPT], max_tokens: 400, temperature: 0}, {
      model: MODEL,
      signal: controller.signal,
      onPartial: (partial) => {
        partials.push(partial)
        controller.abort()
      },
    }).then(
      (result) => assert.fail(`the run was not stopped: ${JSON.stringify(result)}`),
      (error: unknown) => error,
    )
    assert.ok(failure instanceof AbortError, `not an AbortError: ${String(failure)}`)
    assert.equal(failure.jobStatus, 'RUNNING')
    assert.match(failure.jobId ?? '', /^[0-9a-f]{32}$/)
    // (Partials that came in the same read as the first are still handed over.)
    assert.ok(partials.length >= 1)
    const id = failure.jobId!

    // The client's DELETE cancelled the job: the gateway's record says so.
    const snapshot = await ended(id)
    assert.equal(snapshot.status, 'FAILED')
    assert.equal(snapshot.model, MODEL)
    assert.equal(snapshot.terminal?.event, 'error')
    const terminal = snapshot.terminal!.data as {error: {code: string; retryable: boolean}}
    assert.equal(terminal.error.code, 'cancelled')

    // Its events again, by id, read by the package's JobTracker: the same terminal, once, after a
    // beginning of the text the server would have generated, cut short.
    const response = await fetch(`${GATEWAY}/jobs/${id}/events`)
    assert.equal(response.status, 200)
    const events = parseEvents(await response.text())
    assert.equal(terminals(events).length, 1)
    assert.equal(events.at(-1)!.event, 'error')
    const tracker = new JobTracker<GenerateResult, GeneratePartial>()
    const replayed: GeneratePartial[] = []
    for (const event of events) {
      const seen = tracker.observe(event)
      if (seen?.type === 'partial') replayed.push(seen.partial)
    }
    assert.equal(tracker.state.jobId, id)
    assert.equal(tracker.state.done, true)
    assert.equal(tracker.state.result, undefined)
    assert.deepEqual(tracker.state.error, terminal.error)
    assert.ok(tracker.state.timeline.some((f) => f.status === 'RUNNING'))
    assert.deepEqual(replayed.slice(0, partials.length), partials)
    const [text] = joined(replayed, 1)
    assert.ok(whole.startsWith(text!) && text!.length < whole.length, `not a beginning of the server's answer: ${JSON.stringify(text)}`)
  })

  test('a stream cut after its first partial is resumed by the client from the event after it, to the same result', async () => {
    const requests: {method: string; path: string; lastEventId: string | null}[] = []
    let cut = false
    // Hands the client the first stream only up to the end of its first partial event, then breaks it.
    const cutting: typeof fetch = async (input, init) => {
      const url = new URL(input instanceof Request ? input.url : String(input))
      requests.push({method: init?.method ?? 'GET', path: url.pathname, lastEventId: new Headers(init?.headers).get('Last-Event-ID')})
      const response = await fetch(input, init)
      if (cut || !response.body) return response
      cut = true
      const reader = response.body.getReader()
      const decoder = new TextDecoder()
      let text = ''
      const body = new ReadableStream<Uint8Array>({
        async pull(controller) {
          for (;;) {
            const chunk = await reader.read()
            if (chunk.done) {
              controller.enqueue(new TextEncoder().encode(text + decoder.decode()))
              controller.close()
              return
            }
            text += decoder.decode(chunk.value, {stream: true})
            const partial = /(?:^|\n)event: partial\n(?:.*\n)*?\n/.exec(text)
            if (partial) {
              void reader.cancel()
              controller.enqueue(new TextEncoder().encode(text.slice(0, partial.index + partial[0].length)))
              controller.error(new TypeError('connection cut by the test'))
              return
            }
          }
        },
      })
      return new Response(body, {status: response.status, statusText: response.statusText, headers: response.headers})
    }

    const resumes: ResumeInfo[] = []
    const partials: {partial: GeneratePartial; lastEventId: string | undefined}[] = []
    const result = await runTool(GATEWAY, 'generate', {prompts: PROMPTS, max_tokens: 8, temperature: 0}, {
      model: MODEL,
      fetch: cutting,
      onResume: (info) => resumes.push(info),
      onPartial: (partial, state) => partials.push({partial, lastEventId: state.lastEventId}),
    })
    assert.equal(resumes.length, 1)
    assert.ok(resumes[0]!.error instanceof StreamEndedError)
    const first = parseEventId(partials[0]!.lastEventId)
    assert.ok(first, 'the first partial came without an event id')
    assert.deepEqual(requests, [
      {method: 'POST', path: '/generate/run', lastEventId: null},
      {method: 'GET', path: `/jobs/${first.jobId}/events`, lastEventId: `${first.jobId}:${first.seq}`},
    ])
    // Each partial once: they add up to the result, which is the server's own answer.
    const seqs = partials.map((p) => parseEventId(p.lastEventId)!.seq)
    assert.deepEqual(seqs, [...new Set(seqs)].sort((a, b) => a - b))
    assert.deepEqual(joined(partials.map((p) => p.partial), PROMPTS.length), result.completions)
    assert.deepEqual(result.completions, (await direct(PROMPTS, 8)).choices.map((c) => c.text))
    assert.deepEqual((await job(first.jobId)).terminal, {event: 'data', data: result})
  })

  test('a tool the model cannot run is refused with the typed 422 unsupported_by_model, naming why', async () => {
    assert.ok(model.unsupported && 'logit_lens' in model.unsupported, `${MODEL} lists logit_lens as runnable`)
    const examples = EXAMPLES as unknown as Record<string, Record<string, unknown> | undefined>
    const refused = Object.keys(model.unsupported).filter((name) => examples[name])
    assert.ok(refused.includes('logit_lens'))
    for (const name of refused) {
      const failure = await runTool(GATEWAY, name as 'logit_lens', examples[name] as never, {model: MODEL}).then(
        (result) => assert.fail(`${name} ran: ${JSON.stringify(result)}`),
        (error: unknown) => error,
      )
      assert.ok(failure instanceof HttpError, `${name}: not an HttpError: ${String(failure)}`)
      assert.equal(failure.status, 422, name)
      assert.equal(failure.code, 'unsupported_by_model', name)
      assert.equal(failure.retryable, false)
      assert.equal(failure.field, undefined)
      assert.equal(failure.jobId, undefined, 'no job was started')
      assert.equal(failure.message, model.unsupported[name])
    }
    // What the model does run is not refused: the tools `GET /tools` offers it are the model's.
    assert.deepEqual(
      tools.filter((t) => !t.unsupported).map((t) => t.name).sort(),
      [...(model.tools ?? [])].sort(),
    )
  })
})

describe('the dashboard on a model served by vLLM', () => {
  let context: BrowserContext
  let scratch: string

  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-inference-'))
    context = await launch(join(scratch, 'profile'))
  })

  after(async () => {
    await context?.close()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  test('the model picked lists its tools and the ones it cannot run; a generate run shows the completion the gateway recorded', async () => {
    const page = (await context.newPage()) as Page & {errors: string[]}
    await page.setViewportSize({width: 1280, height: 900})
    page.errors = []
    page.on('pageerror', (error) => page.errors.push(error.message))
    page.on('console', (message) => message.type() === 'error' && page.errors.push(message.text()))
    await page.goto(`${GATEWAY}/#generate`)
    await page.waitForSelector('#run[data-tools=gateway] #form [data-field]')

    const picker = page.getByLabel('Model')
    const several = models.models.length > 1
    if (several) {
      assert.ok(await picker.isVisible())
      assert.equal(await picker.isEnabled(), true)
      const options = await page.locator('#model-select option').allInnerTexts()
      assert.deepEqual(options, models.models.map((m) => `${m.name} · ${m.kind}`))
      await picker.selectOption(MODEL)
      await page.waitForSelector(`#run[data-tools=gateway][data-model="${MODEL}"] #form [data-field]`)
      assert.equal(await picker.inputValue(), MODEL)
    } else {
      // A gateway of one model has no picker: its runs go to that model.
      assert.equal(await picker.isVisible(), false)
    }
    // The model line: the model, its kind and where it runs (`/readyz` names no model on a server: `GET /models` does).
    assert.equal(await page.locator('#model').innerText(), [model.name, model.kind, model.device, model.dtype].filter(Boolean).join(' · '))

    // The tools are the model's: those it runs in the picker, the others listed apart with the gateway's reasons.
    const runnable = tools.filter((t) => !t.unsupported).map((t) => t.name)
    assert.deepEqual(await page.locator('#tool option').allInnerTexts(), runnable)
    assert.deepEqual([...runnable].sort(), [...(model.tools ?? [])].sort())
    assert.equal(await page.locator('#tool').inputValue(), 'generate')
    const box = page.locator('#unsupported')
    const unsupported = await box.locator('summary code').allInnerTexts()
    assert.deepEqual([...unsupported].sort(), Object.keys(model.unsupported ?? {}).sort())
    assert.ok(unsupported.includes('logit_lens'))
    await box.locator('summary').click()
    const reason = box.locator('li[data-tool=logit_lens]')
    await reason.waitFor({state: 'visible'})
    assert.equal(await reason.innerText(), model.unsupported!.logit_lens)

    await page.fill('[data-field=prompts] textarea', PROMPTS[1]!)
    await page.fill('[data-field=max_tokens] input', '8')
    await page.fill('[data-field=temperature] input', '0')
    const card = await run(page)
    await finished(card)

    // The gateway's record of the job the card shows.
    const id = await card.locator('.job-id').getAttribute('title')
    assert.match(id ?? '', /^[0-9a-f]{32}$/)
    const snapshot = await job(id!)
    assert.equal(snapshot.status, 'SUCCEEDED')
    assert.equal(snapshot.model, MODEL)
    assert.equal(snapshot.terminal?.event, 'data')
    const recorded = snapshot.terminal!.data as GenerateResult
    assert.equal(recorded.completions.length, 1)
    const [completion] = recorded.completions
    assert.ok(completion!.length > 0)
    assert.equal(await card.locator('.result .completion-text').textContent(), completion)
    // The text streamed into the card as it came is the same.
    assert.equal(await card.locator('.tokens .completion-text').textContent(), completion)
    assert.deepEqual(await rawResult<GenerateResult>(card), recorded)
    // And it is what the server answers to the same greedy request.
    assert.equal(completion, (await direct([PROMPTS[1]!], 8)).choices[0]!.text)
    const steps = await card.locator('.timeline li').evaluateAll((items) => items.map((li) => li.getAttribute('data-status')))
    assert.ok(steps.includes('RUNNING'), `the timeline: ${steps.join(', ')}`)
    assert.equal(steps.at(-1), 'done')
    if (several) assert.equal(await card.locator('.job-model').innerText(), MODEL)
    await page.screenshot({path: join(ARTIFACTS, 'inference-server.png'), fullPage: true})
    assert.deepEqual(page.errors, [])
    await page.close()
  })
})
