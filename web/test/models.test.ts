/**
 * Several models behind one gateway: `listModels`, and runs sent to one by the `model` option,
 * against a real gateway serving two tiny Llamas of the same shape but other weights (seed 0,
 * the default, and seed 1); and `listModels`'s errors against a fetch that answers from memory.
 */
import assert from 'node:assert/strict'
import {mkdtempSync, rmSync} from 'node:fs'
import {tmpdir} from 'node:os'
import {join} from 'node:path'
import {after, before, describe, test} from 'node:test'

import {
  AbortError,
  EXAMPLES,
  HttpError,
  listModels,
  ProtocolError,
  runAndStream,
  runTool,
  StreamEndedError,
  type LoglikelihoodResult,
  type ToolInfo,
} from '../src/index.ts'
// The gateway's record of a job (the package's own `JobSnapshot` is what an error knows of one).
import type {JobSnapshot} from '../src/generated/types.ts'
import {fakeFetch} from './support/fake.ts'
import {buildModel, freePort, startGateway, tinyModel, type Gateway} from './support/gateway.ts'
import {failure} from './support/play.ts'

describe('two models behind one gateway', () => {
  let gateway: Gateway
  let scratch: string

  before(async () => {
    scratch = mkdtempSync(join(tmpdir(), 'streamgate-models-'))
    gateway = await startGateway(['--max-batch-size', '1'], {base: tinyModel(), other: buildModel('llama', join(scratch, 'other'), 1)})
  })

  after(async () => {
    await gateway?.stop()
    if (scratch) rmSync(scratch, {recursive: true, force: true})
  })

  /** The gateway's record of the job: which model it ran on. */
  const jobOf = async (id: string | undefined) => {
    assert.ok(id, 'the run told no job id')
    return (await (await fetch(`${gateway.url}/jobs/${id}`)).json()) as JobSnapshot
  }

  test('listModels: both, the default first, each with its kind and the tools it runs', async () => {
    const list = await listModels(gateway.url)
    assert.equal(list.default, 'base')
    assert.deepEqual(list.models.map((m) => [m.name, m.default, m.ready, m.kind]), [
      ['base', true, true, 'causal_lm'],
      ['other', false, true, 'causal_lm'],
    ])
    for (const model of list.models) {
      assert.ok(model.tools?.includes('loglikelihood'), `${model.name}: ${model.tools?.join(', ')}`)
      assert.deepEqual(Object.keys(model.unsupported ?? {}).sort(), ['fill_mask', 'pseudo_loglikelihood'])
    }
    // A base URL with a path and a trailing slash, as runTool takes it.
    assert.deepEqual(await listModels(new URL(`${gateway.url}/`)), list)
  })

  test('the model option: the named model runs the job, as `model` in the JSON body does; the two models differ', async () => {
    const params = EXAMPLES.loglikelihood
    let jobId: string | undefined
    const other = await runTool(gateway.url, 'loglikelihood', params, {model: 'other', onStatus: (frame) => (jobId = frame.job_id)})
    assert.equal((await jobOf(jobId)).model, 'other')
    // The same params with `model` in the body, sent by the URL.
    const direct = await runAndStream<LoglikelihoodResult>(`${gateway.url}/loglikelihood/run`, {...params, model: 'other'})
    assert.deepEqual(other, direct)
    const base = await runTool(gateway.url, 'loglikelihood', params, {model: 'base', onStatus: (frame) => (jobId = frame.job_id)})
    assert.equal((await jobOf(jobId)).model, 'base')
    assert.notDeepEqual(base.ll, other.ll, 'two models of other weights scored the same')
    // No model: the default's.
    const unnamed = await runTool(gateway.url, 'loglikelihood', params, {onStatus: (frame) => (jobId = frame.job_id)})
    assert.deepEqual(unnamed, base)
    assert.equal((await jobOf(jobId)).model, 'base')
    // The option is sent in place of the params' own.
    const replaced = await runTool(gateway.url, 'loglikelihood', {...params, model: 'base'}, {model: 'other'})
    assert.deepEqual(replaced, other)
  })

  test('each model’s jobs are listed with it', async () => {
    let jobId: string | undefined
    await runTool(gateway.url, 'predict', {prompt: 'x', top_k: 2}, {model: 'other', onStatus: (frame) => (jobId = frame.job_id)})
    const listed = (await (await fetch(`${gateway.url}/jobs`)).json()) as {jobs: JobSnapshot[]}
    const mine = listed.jobs.find((j) => j.job_id === jobId)
    assert.ok(mine, `job ${jobId} is not in GET /jobs: ${JSON.stringify(listed).slice(0, 300)}`)
    assert.equal(mine.model, 'other')
  })

  test('GET /tools?model=NAME: the tools that model cannot run, with their reasons', async () => {
    const list = await listModels(gateway.url)
    const tools = (await (await fetch(`${gateway.url}/tools?model=other`)).json()) as ToolInfo[]
    const other = list.models.find((m) => m.name === 'other')!
    assert.deepEqual(Object.fromEntries(tools.filter((t) => t.unsupported).map((t) => [t.name, t.unsupported])), other.unsupported)
  })

  test('an unknown model: HttpError 404 unknown_model on the model field, and no job', async () => {
    const statuses: string[] = []
    const error = await failure(runTool(gateway.url, 'predict', {prompt: 'x'}, {model: 'nope', onStatus: (f) => statuses.push(f.status)}))
    assert.ok(error instanceof HttpError, String(error))
    assert.equal(error.status, 404)
    assert.equal(error.code, 'unknown_model')
    assert.equal(error.field, 'model')
    assert.equal(error.retryable, false)
    assert.match(error.message, /nope.*base, other/)
    assert.equal(error.jobId, undefined)
    assert.deepEqual(statuses, [])
  })

  test('the model option needs params that are an object', async () => {
    const error = await failure(runAndStream(`${gateway.url}/predict/run`, ['x'], {model: 'other'}))
    assert.ok(error instanceof TypeError, String(error))
  })
})

describe('listModels: errors', () => {
  const MODELS = {default: 'base', models: [{name: 'base', default: true, ready: true}]}

  test('sends Accept and the caller’s headers to GET {base}/models', async () => {
    const {fetch, calls} = fakeFetch(() => ({status: 200, headers: {'Content-Type': 'application/json'}, chunks: [JSON.stringify(MODELS)]}))
    assert.deepEqual(await listModels('http://gateway.test/api', {fetch, headers: {Authorization: 'Bearer t'}}), MODELS)
    assert.equal(calls[0]!.url, 'http://gateway.test/api/models')
    assert.equal(calls[0]!.method, 'GET')
    assert.equal(calls[0]!.headers.get('Authorization'), 'Bearer t')
    assert.equal(calls[0]!.headers.get('Accept'), 'application/json')
  })

  test('a refusal: HttpError with the body’s code', async () => {
    const body = {error: {code: 'unauthorized', message: 'a token is needed', retryable: false}}
    const {fetch} = fakeFetch(() => ({status: 401, headers: {'Content-Type': 'application/json'}, chunks: [JSON.stringify(body)]}))
    const error = await failure(listModels('http://gateway.test', {fetch}))
    assert.ok(error instanceof HttpError, String(error))
    assert.equal(error.status, 401)
    assert.equal(error.code, 'unauthorized')
  })

  test('an answer that is not a model list (an older gateway’s page, a proxy’s): ProtocolError', async () => {
    for (const chunk of ['<html>dashboard</html>', '[{"name":"generate"}]', '{"default":"a","models":[{"kind":"x"}]}']) {
      const {fetch} = fakeFetch(() => ({status: 200, chunks: [chunk]}))
      const error = await failure(listModels('http://gateway.test', {fetch}))
      assert.ok(error instanceof ProtocolError, `${chunk}: ${String(error)}`)
    }
  })

  test('a gateway that cannot be reached: StreamEndedError; an aborted signal: AbortError', async () => {
    const port = await freePort() // nothing listens there
    const error = await failure(listModels(`http://127.0.0.1:${port}`))
    assert.ok(error instanceof StreamEndedError, String(error))
    assert.match(error.message, /^could not reach the gateway/)
    const controller = new AbortController()
    controller.abort()
    assert.ok((await failure(listModels(`http://127.0.0.1:${port}`, {signal: controller.signal}))) instanceof AbortError)
    const {fetch} = fakeFetch(() => ({status: 200, hang: true}))
    const later = new AbortController()
    const pending = failure(listModels('http://gateway.test', {fetch, signal: later.signal}))
    later.abort()
    assert.ok((await pending) instanceof AbortError)
  })
})
