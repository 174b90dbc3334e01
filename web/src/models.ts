/**
 * `listModels`: the models a gateway serves (`GET /models`), the default first, each with
 * what it is and which tools it runs. A run picks one with the `model` option (or its
 * params' `model`); without one it runs on the default.
 */
import {AbortError, HttpError, ProtocolError, StreamEndedError} from './errors.ts'
import type {ModelList} from './generated/types.ts'
import {gatewayUrl, type RequestOptions} from './run.ts'

/**
 * `GET /models` of the gateway at `baseUrl`. Rejects as a run's start does: `HttpError` when the
 * gateway refuses, `StreamEndedError` when it cannot be reached, `AbortError` when `signal`
 * aborts, and `ProtocolError` when the answer is not a model list (an older gateway's page, a proxy's).
 */
export async function listModels(baseUrl: string | URL, options: RequestOptions = {}): Promise<ModelList> {
  const doFetch = options.fetch ?? globalThis.fetch
  const {signal} = options
  if (signal?.aborted) throw new AbortError('aborted before the request was sent', {}, {cause: signal.reason})
  const headers = new Headers(options.headers)
  headers.set('Accept', 'application/json')
  let response: Response
  let text: string
  try {
    response = await doFetch(gatewayUrl(baseUrl, 'models'), {headers, ...(signal ? {signal} : {})})
    if (!response.ok) throw await HttpError.fromResponse(response)
    text = await response.text()
  } catch (error) {
    if (error instanceof HttpError) throw error
    if (signal?.aborted) throw new AbortError('aborted', {}, {cause: signal.reason})
    throw new StreamEndedError(`could not reach the gateway: ${error instanceof Error ? error.message : String(error)}`, {}, {cause: error})
  }
  let body: unknown
  try {
    body = JSON.parse(text)
  } catch {
    throw new ProtocolError(`GET /models answered something that is not JSON: ${text.slice(0, 120)}`)
  }
  if (!isModelList(body)) throw new ProtocolError(`GET /models answered something that is not a model list: ${text.slice(0, 120)}`)
  return body
}

/** The shape the client relies on: the default's name, and each model's name; the rest is read as typed. */
function isModelList(body: unknown): body is ModelList {
  if (typeof body !== 'object' || body === null) return false
  const {default: name, models} = body as {default?: unknown; models?: unknown}
  return (
    (name === null || typeof name === 'string') &&
    Array.isArray(models) &&
    models.every((m) => typeof m === 'object' && m !== null && typeof (m as {name?: unknown}).name === 'string')
  )
}
