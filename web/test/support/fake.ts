/** A fetch that answers from bytes in memory, chunked as a test says, and records every call. */

export interface Call {
  url: string
  method: string
  headers: Headers
  body: string | undefined
}

export interface FakeAnswer {
  status?: number
  headers?: Record<string, string>
  /** The body, already cut into chunks; a string chunk is UTF-8 encoded. */
  chunks?: (Uint8Array | string)[]
  /** Keep the stream open after the chunks (until aborted). */
  hang?: boolean
  /** Break the stream with this error after the chunks. */
  breakWith?: Error
}

export type Route = (call: Call) => FakeAnswer | Error

export function fakeFetch(route: Route): {fetch: typeof fetch; calls: Call[]} {
  const calls: Call[] = []
  const encoder = new TextEncoder()
  const fetchImpl = async (input: string | URL | Request, init: RequestInit = {}): Promise<Response> => {
    const call: Call = {
      url: String(input),
      method: init.method ?? 'GET',
      headers: new Headers(init.headers),
      body: typeof init.body === 'string' ? init.body : undefined,
    }
    calls.push(call)
    const answer = route(call)
    if (answer instanceof Error) throw answer
    const signal = init.signal ?? undefined
    if (signal?.aborted) throw signal.reason
    const chunks = (answer.chunks ?? []).map((c) => (typeof c === 'string' ? encoder.encode(c) : c))
    let i = 0
    const body = new ReadableStream<Uint8Array>({
      pull(controller) {
        if (i < chunks.length) {
          controller.enqueue(chunks[i++]!)
          return
        }
        if (answer.breakWith) {
          controller.error(answer.breakWith)
          return
        }
        if (!answer.hang) {
          controller.close()
          return
        }
        return new Promise<void>((resolve) => {
          const fail = () => {
            controller.error(signal?.reason ?? new Error('aborted'))
            resolve()
          }
          if (signal?.aborted) fail()
          else signal?.addEventListener('abort', fail, {once: true})
        })
      },
    })
    const status = answer.status ?? 200
    // A 204 or 304 has no body: a Response refuses one.
    return new Response(status === 204 || status === 304 ? null : body, {
      status,
      headers: answer.headers ?? {'Content-Type': 'text/event-stream; charset=utf-8'},
    })
  }
  return {fetch: fetchImpl as typeof fetch, calls}
}

/** Every way of cutting `bytes` in two, plus one byte at a time. */
export function* cuts(bytes: Uint8Array): Generator<{name: string; chunks: Uint8Array[]}> {
  for (let i = 0; i <= bytes.length; i++) {
    yield {name: `cut at byte ${i}`, chunks: [bytes.slice(0, i), bytes.slice(i)]}
  }
  yield {name: 'one byte at a time', chunks: Array.from(bytes, (_, i) => bytes.slice(i, i + 1))}
}
