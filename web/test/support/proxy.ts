/** A TCP proxy on loopback whose connections a test can cut, as a flaky network would. */
import {connect, createServer, type Socket} from 'node:net'

export interface Proxy {
  url: string
  /** Cut every open connection (new ones are still accepted). */
  drop: () => void
  /**
   * Cut the connection of the next request once `at` bytes of the gateway's answer (headers
   * included) have passed to the client (0: before any), or, for `{before, plus}`, once it has
   * passed up to `plus` bytes past the first `before` in the answer. Resolves with all the
   * gateway had sent by then.
   */
  cutNext: (at: CutAt) => Promise<string>
  /** From now on, stop passing a connection's answer once `marker` has passed `n` times on it. */
  holdAfter: (marker: string, n: number) => void
  /** Bytes of the gateway's answer passed on each connection closed so far (since its last request). */
  answered: number[]
  close: () => Promise<void>
}

export type CutAt = number | {before: string | RegExp; plus?: number}

const REQUEST_LINE = /^(GET|POST|DELETE|PUT|PATCH|HEAD|OPTIONS) /

export async function startProxy(target: string): Promise<Proxy> {
  const {hostname, port} = new URL(target)
  const sockets = new Set<Socket>()
  const cuts: {at: CutAt; resolve: (seen: string) => void}[] = []
  const answered: number[] = []
  let holdAt: {marker: string; n: number} | undefined
  const server = createServer((client) => {
    const hold = {held: false}
    let markers = 0
    const upstream = connect(Number(port), hostname)
    // Cuts are taken per request, not per connection: a kept-alive connection carries several.
    let cut: (typeof cuts)[number] | undefined
    let passed = 0
    let seen = Buffer.alloc(0)
    let ended = false
    let cutting = false
    const end = () => {
      if (ended) return
      ended = true
      answered.push(passed)
      // A cut lets what was already written reach the client first, then closes.
      if (cutting) client.end(() => client.destroy())
      else client.destroy()
      upstream.destroy()
      sockets.delete(client)
      sockets.delete(upstream)
      cut?.resolve(seen.toString())
    }
    for (const socket of [client, upstream]) {
      sockets.add(socket)
      socket.on('error', end)
      socket.on('close', end)
    }
    client.on('data', (data: Buffer) => {
      if (REQUEST_LINE.test(data.subarray(0, 8).toString('latin1'))) {
        passed = 0
        seen = Buffer.alloc(0)
        cut ??= cuts.shift()
      }
      upstream.write(data)
    })
    // How far the answer may go: while a marker is not found yet, a tail that may be its start waits.
    const limit = (at: CutAt): number => {
      if (typeof at === 'number') return at
      // latin1: one character per byte, so a match's index is its offset.
      const found = typeof at.before === 'string' ? seen.indexOf(at.before) : seen.toString('latin1').search(at.before)
      return found >= 0 ? found + (at.plus ?? 0) : seen.length - (typeof at.before === 'string' ? at.before.length - 1 : 256)
    }
    upstream.on('data', (data: Buffer) => {
      if (cutting || hold.held) return
      if (!cut) {
        client.write(data)
        passed += data.length
        if (holdAt) {
          markers += data.toString('latin1').split(holdAt.marker).length - 1
          hold.held = markers >= holdAt.n
        }
        return
      }
      seen = Buffer.concat([seen, data])
      const upTo = Math.min(limit(cut.at), seen.length)
      if (upTo > passed) client.write(seen.subarray(passed, upTo))
      passed = Math.max(passed, upTo)
      if (upTo < seen.length) {
        cutting = true
        end()
      }
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const address = server.address()
  const url = `http://127.0.0.1:${typeof address === 'object' && address ? address.port : 0}`
  return {
    url,
    answered,
    drop: () => {
      for (const socket of sockets) socket.destroy()
    },
    holdAfter: (marker, n) => {
      holdAt = {marker, n}
    },
    cutNext: (at) => new Promise((resolve) => cuts.push({at, resolve})),
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy()
        server.close(() => resolve())
      }),
  }
}
