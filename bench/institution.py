"""Memory over an institution's use: thousands of signed-in users, metered classes, and completion
webhooks to a receiver that is down.

One `streamgate serve` (the tests' tiny Llama: a noop job does not depend on it) with its engine process,
signing users in with an OpenID Connect issuer served here on loopback (a key pair and its JWKS),
a tokens file whose default class has quotas (so that every run is checked against the meter and
settled into it), and a `--webhook-secret`. The webhook receiver is down: its port refuses every
connection, so each delivery is tried again with backoff and stays open (`--webhook-attempts 30`).

Users 1..N (default 24,000; --quick 600), each with a JWT of its own (`sub` user-i), run one
`noop` job each, 8 at a time, naming the receiver in `Callback-URL`; one refused 429 because the
gateway holds as many open deliveries as it may (10,000) runs again without it, as a client that
falls back to reading its stream would. Memory is the resident memory of the gateway and its
engine together (from /proc), after every tenth of the users, against idle (after 50 warm-up
users of its own).

Everything a user leaves behind is capped: 10,000 verified JWTs, 10,000 open deliveries (then
429), 10,000 finished jobs kept (`--max-finished-jobs`), per-token limits only while they count,
and a usage row per tenant (100,000 at most). Target: past the first three caps (the last half of
the users, on a full run), memory grows by at most 1 KiB a user, a new tenant's usage row; and
every run is answered 200, or 429 with `Retry-After`, never a 5xx.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from tests.support.oidc_issuer import AUDIENCE, LocalIssuer  # noqa: E402

TITLE = "institution: signed-in users by the thousand, metered classes, webhooks to a receiver that is down"
SECRET = "whsec_" + "YSB3ZWJob29rIHNlY3JldCBvZiAzMiBieXRlcy4uLi4="
AT_ONCE = 8
WARM = 50
TOKENS = """
[classes.members]
default = true
tokens_per_day = 1000000000
device_seconds_per_day = 1000000
"""
NOOP = msgspec.json.encode({"partials": 2, "size": 16})


def options(parser: Any) -> None:
    parser.add_argument("--users", type=int, default=None, help="Signed-in users, one run each (default 24000; --quick 600).")


def resident_mb(pids: list[int]) -> float:
    return sum(common.rss_kb(pid) for pid in pids) / 1024


async def one_user(port: int, issuer: LocalIssuer, user: int, callback: str, answers: collections.Counter[str]) -> None:
    """User `user`'s run with its own JWT, naming the callback; again without it if the gateway holds
    as many deliveries as it may."""
    token = issuer.token("k1", sub=f"user-{user}")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    for named in (True, False):
        sent = {**headers, "Callback-URL": callback} if named else headers
        run = await common.run_job(port, "/noop/run", msgspec.json.decode(NOOP), headers=sent)
        ended = run.events[-1].event if run.events else None
        if run.status == 200 and ended == "data":
            answers["200, its webhook open" if named else "200, without its webhook"] += 1
            return
        if run.status == 429 and named and b"webhooks" in run.body and run.headers.get("retry-after"):
            answers["429 (the gateway's deliveries full), Retry-After"] += 1
            continue
        answers[f"{run.status} {ended or run.body[:80]!r}"] += 1
        return


async def users(port: int, issuer: LocalIssuer, first: int, count: int, callback: str, answers: collections.Counter[str]) -> None:
    """Users first..first+count-1, AT_ONCE at a time."""
    pending = iter(range(first, first + count))

    async def worker() -> None:
        for user in pending:
            await one_user(port, issuer, user, callback, answers)

    await asyncio.gather(*(worker() for _ in range(AT_ONCE)))


async def run(bench: common.Bench, report: common.Report) -> None:
    quick = bench.quick
    count = bench.args.users or (600 if quick else 24_000)
    issuer = LocalIssuer()
    issuer.add_key("k1", "ec")  # ES256: its signing here costs the clients little
    tokens = bench.dir / "tokens.toml"
    tokens.write_text(TOKENS)
    down = common.free_port()  # nothing listens on it: every try is refused at once
    model = bench.model(default_tiny=True)  # a noop job: the figures do not depend on the model
    gateway = bench.streamgate(
        "serve", "--oidc-issuer", issuer.url, "--oidc-audience", AUDIENCE, "--tokens-file", str(tokens),
        "--webhook-secret", SECRET, "--callback-hosts", "127.0.0.1", "--webhook-attempts", "30", "--detach-grace", "30",
        model=model,
    )
    bench.ready(gateway)
    info = common.readyz(gateway)
    port = common.port_of(gateway)
    pids = [gateway.proc.pid, *(e["pid"] for e in info.get("engines", []) if e.get("pid"))]
    report.fact("machine", common.machine(info.get("device", "cpu")))
    report.fact("load", f"{count} signed-in users (ES256 JWTs), one noop run each, {AT_ONCE} at a time, each naming a webhook receiver that refuses connections")
    callback = f"http://127.0.0.1:{down}/hooks/streamgate"
    answers: collections.Counter[str] = collections.Counter()

    common.step(f"warming up: {WARM} users")
    await users(port, issuer, -WARM, WARM, callback, collections.Counter())
    await asyncio.sleep(1)
    idle = resident_mb(pids)
    samples: list[list[Any]] = []
    tenth = max(1, count // 10)
    started = time.time()
    for first in range(0, count, tenth):
        step = min(tenth, count - first)
        await users(port, issuer, first, step, callback, answers)
        mb = resident_mb(pids)
        samples.append([first + step, round(mb, 1), round(mb - idle, 1), round(time.time() - started)])
        common.step(f"{first + step} users: {mb:.0f} MB")
    report.table(["users", "RSS MB", "over idle MB", "seconds"], samples,
                 title=f"gateway + engine memory as signed-in users come and go (idle {idle:.0f} MB)")
    report.table(["answer", "runs"], [[what, n] for what, n in sorted(answers.items())], title="what the runs were answered")

    half = next(row for row in samples if row[0] >= count // 2)
    grown_kib = (samples[-1][1] - half[1]) * 1024 / max(1, samples[-1][0] - half[0])
    report.target(
        "past 10,000 JWTs, open deliveries and finished jobs kept (the last half of the users): memory grows <= 1 KiB a user",
        f"{grown_kib:.2f} KiB a user ({half[0]} -> {samples[-1][0]} users: {samples[-1][1] - half[1]:+.1f} MB)", grown_kib <= 1.0,
    )
    fine = {"200, its webhook open", "200, without its webhook", "429 (the gateway's deliveries full), Retry-After"}
    others = sum(n for what, n in answers.items() if what not in fine)
    report.target("every run answered 200, or 429 with Retry-After (never a 5xx)", f"{others} otherwise", others == 0)
    issuer.stop()


if __name__ == "__main__":
    common.main(run, TITLE, __doc__, options)
