"""Python clients for a streamgate server, built on httpx and httpx-sse: `Client` and `AsyncClient`.

    from gateway.client import Client

    with Client("http://127.0.0.1:8000") as client:
        result = client.run("generate", {"prompts": ["Hello"], "max_tokens": 8},
                            on_partial=lambda p: print(p["text"], end=""))

`run` returns the `data` event's payload or raises: `HttpError` (the server
refused before the stream opened), `JobError` (an `error` event), or
`StreamEndedError` (the stream kept ending without a terminal event). A dropped
connection is resumed where it left off (`X-Job-Id` and the last event id).

Many jobs, a few at a time, each one's outcome in input order:

    for outcome in client.run_many("embed", ({"texts": [s]} for s in sequences), concurrency=8):
        print(outcome.index, outcome.result if outcome.ok else outcome.error)

`AsyncClient` has the same methods as coroutines (`stream` and `run_many` as
async iterators), on `httpx.AsyncClient`:

    async with AsyncClient(url) as client:
        result = await client.run("predict", {"prompt": "Hi"})
        async for outcome in client.run_many("predict", params):
            ...

The requests, the resuming and the retrying are written once, in
`AsyncClient`; `Client` runs an `AsyncClient` on an event loop of its own (on a
thread of its own), so it blocks as a sync client does, inside a running event
loop as well as outside one.
"""

from gateway.client.asynchronous import AsyncClient
from gateway.client.outcomes import ClientError, HttpError, JobError, Outcome, StreamEndedError, StreamEvent
from gateway.client.synchronous import Client

__all__ = ["AsyncClient", "Client", "ClientError", "HttpError", "JobError", "Outcome", "StreamEndedError", "StreamEvent"]
