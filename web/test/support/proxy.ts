/** A TCP proxy on loopback whose connections a test can cut, as a flaky network would. */
import {connect, createServer, type Socket} from 'node:net'

export interface Proxy {
  url: string
  /** Cut every open connection (new ones are still accepted). */
  drop: () => void
  close: () => Promise<void>
}

export async function startProxy(target: string): Promise<Proxy> {
  const {hostname, port} = new URL(target)
  const sockets = new Set<Socket>()
  const server = createServer((client) => {
    const upstream = connect(Number(port), hostname)
    const end = () => {
      client.destroy()
      upstream.destroy()
      sockets.delete(client)
      sockets.delete(upstream)
    }
    for (const socket of [client, upstream]) {
      sockets.add(socket)
      socket.on('error', end)
      socket.on('close', end)
    }
    client.pipe(upstream)
    upstream.pipe(client)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const address = server.address()
  const url = `http://127.0.0.1:${typeof address === 'object' && address ? address.port : 0}`
  return {
    url,
    drop: () => {
      for (const socket of sockets) socket.destroy()
    },
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy()
        server.close(() => resolve())
      }),
  }
}
