"""Many clients following jobs' event streams the way EventSource does, in one process of their own.

`python -m tests.support.sse_swarm --port P --clients N --retry-ms R JOB_ID ...`: client
`i` follows `GET /jobs/{JOB_IDS[i % len]}/events` on loopback. Like an
EventSource (and the Python and TypeScript clients) each one reconnects R ms
after its stream ends without a terminal event, or after a refused
connection, sending `Last-Event-ID`; like the project's clients it also waits
out a 503's `Retry-After` and tries again. It stops at its job's terminal
event (or a 204: it holds it already).

It prints `connected` once every client has read an event, then, when all are
done or `--deadline` s have passed, one JSON line: per client the seqs it read
in order, how its stream ended, and what it met on the way (connections, 503s
with their Retry-After, refused connects, and when its first connection after
the first cut was accepted). Kept in its own process so that thousands of
clients do not share a GIL with the servers under test.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

import msgspec

from bench.common import Response


@dataclass
class Client:
    job_id: str
    seqs: list[int] = field(default_factory=list)
    terminal: str = ""
    connections: int = 0
    refused: int = 0
    overloaded: list[int] = field(default_factory=list)  # each 503's Retry-After
    other: list[str] = field(default_factory=list)  # any other answer: status and error code
    cut: bool = False  # a stream of its ended without the terminal event
    back_at: float | None = None  # time.time() its first connection after a cut was accepted


async def follow(
    client: Client, port: int, retry: float, opening: asyncio.Semaphore, started: asyncio.Event, count: list[int]
) -> None:
    announced = False
    while not client.terminal:
        headers = {"Last-Event-ID": f"{client.job_id}:{client.seqs[-1]}"} if client.seqs else {}
        try:
            if not client.connections:  # the first connections go a few hundred at a time
                async with opening:
                    response = await Response.open(port, "GET", f"/jobs/{client.job_id}/events", headers=headers)
            else:
                response = await Response.open(port, "GET", f"/jobs/{client.job_id}/events", headers=headers)
        except (OSError, asyncio.IncompleteReadError):
            client.refused += 1
            await asyncio.sleep(retry)
            continue
        if client.cut and client.back_at is None:
            client.back_at = response.sent
        try:
            if response.status == 204:
                client.terminal = "held"
            elif response.status != 200:
                error = msgspec.json.decode(await response.body())["error"]
                code = error["code"]
                if response.status == 503 and code == "overloaded":
                    client.overloaded.append(int(response.headers["retry-after"]))
                    await asyncio.sleep(client.overloaded[-1])
                else:
                    client.other.append(f"{response.status} {code}: {error['message']}")
                    await asyncio.sleep(retry)
            else:
                client.connections += 1
                async for event in response.events():
                    client.seqs.append(int(event.id.rsplit(":", 1)[1]))
                    if not announced:
                        announced = True
                        count[0] += 1
                        if count[0] == count[1]:
                            started.set()
                    if event.event in ("data", "error"):
                        client.terminal = event.event
                if not client.terminal:
                    client.cut = True
                    await asyncio.sleep(retry)
        except (OSError, asyncio.IncompleteReadError):
            client.cut = True
            await asyncio.sleep(retry)
        finally:
            response.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--retry-ms", type=int, default=500)
    parser.add_argument("--deadline", type=float, default=120)
    parser.add_argument("job_ids", nargs="+")
    args = parser.parse_args()
    clients = [Client(args.job_ids[i % len(args.job_ids)]) for i in range(args.clients)]
    started = asyncio.Event()
    count = [0, len(clients)]
    opening = asyncio.Semaphore(256)  # within the server's listen backlog
    retry = args.retry_ms / 1000
    tasks = [asyncio.create_task(follow(client, args.port, retry, opening, started, count)) for client in clients]

    async def announce() -> None:
        await started.wait()
        print("connected", flush=True)

    announcer = asyncio.create_task(announce())
    await asyncio.wait(tasks, timeout=args.deadline)
    announcer.cancel()
    for task in tasks:
        task.cancel()
    sys.stdout.write(msgspec.json.encode([client.__dict__ for client in clients]).decode() + "\n")


if __name__ == "__main__":
    asyncio.run(main())
