/** A TCP proxy on loopback whose connections a test can cut, as a flaky network would. */
import {connect, createServer, type Socket} from 'node:net'

export interface Proxy {
  url: string
  /** Cut every open connection (new ones are still accepted). */
  drop: () => void
  /**
   * Cut the connection of the next request once `bytes` of the gateway's answer (headers
   * included) have passed to the client (0: before any). Resolves with all the gateway had sent
   * by then.
   */
  cutNext: (bytes: number) => Promise<string>
  /** Bytes of the gateway's answer passed on each connection closed so far (since its last request). */
  answered: number[]
  close: () => Promise<void>
}

const REQUEST_LINE = /^(GET|POST|DELETE|PUT|PATCH|HEAD|OPTIONS) /

export async function startProxy(target: string): Promise<Proxy> {
  const {hostname, port} = new URL(target)
  const sockets = new Set<Socket>()
  const cuts: {bytes: number; resolve: (seen: string) => void}[] = []
  const answered: number[] = []
  const server = createServer((client) => {
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
        cut ??= cuts.shift()
      }
      upstream.write(data)
    })
    upstream.on('data', (data: Buffer) => {
      if (cutting) return
      if (cut) seen = Buffer.concat([seen, data])
      const room = cut ? Math.max(0, cut.bytes - passed) : data.length
      if (room > 0) client.write(room < data.length ? data.subarray(0, room) : data)
      passed += Math.min(room, data.length)
      if (cut && passed >= cut.bytes) {
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
    cutNext: (bytes) => new Promise((resolve) => cuts.push({bytes, resolve})),
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy()
        server.close(() => resolve())
      }),
  }
}
