"""Server settings: one Struct, the single declaration of every `serve` and `executor` setting.

Each field's `Meta` holds its range and its help; `extra` holds what a type cannot say: `only`, the
one command that has it; `flag`, its flag when not named after the field; `split`, one value listed
at commas (`--devices cuda:0,cuda:1`) where other lists repeat their flag; `env_split`, a repeated
flag whose `STREAMGATE_*` variable lists at commas rather than spaces (paths hold spaces, sources
do not); `unit`, sizes written with units; `path`, a file's path; `expected`, a pattern's meaning.

The CLI generates its options from it (gateway/cli/commands.py), so a flag, its variable, its range
and its help come from here. A config file or a Serve config's `args` are decoded into it (`decode`),
`STREAMGATE_*` variables too where no CLI reads them (`environ`), and every source ends in `build`:
the Struct's own checks and the rules between settings, enforced here and nowhere else. A file's
or a variable's value is refused in the words the flag's own check uses, naming the key.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from gateway.cost import DEFAULT_FILE_BYTES, DEFAULT_JOURNAL_BYTES, DEFAULT_RESULT_BYTES

SERVE = {"only": "serve"}
# --max-job-memory's default under --engine-memory-limit: this share of the limit (a quarter).
ENGINE_SHARE = 4
EXECUTOR = {"only": "executor"}
BYTES = {"unit": "bytes"}


class Settings(msgspec.Struct, kw_only=True):
    # Both commands': the process that loads the models and runs tools. In --help's order.
    host: Annotated[str, Meta(description="Interface to listen on.")] = "127.0.0.1"
    port: Annotated[int, Meta(extra={"executor_default": 9000})] = 8000
    model: Annotated[list[str], Meta(extra={"env_split": ","}, description="[NAME=]SOURCE: a local folder, .gguf file or Hugging Face id, served as NAME (default: the folder's or file's name); vllm:PATH, a vLLM server the gateway starts on PATH; openai+http(s)://HOST/v1, an OpenAI-compatible server already running (NAME= required). Repeatable: several models side by side, the first the default; a run picks one with its `model` param. Default: the bundled SmolLM2-135M-Instruct.")] = msgspec.field(default_factory=list)
    model_loader: Annotated[list[str], Meta(extra={"env_split": ","}, description="[NAME=]module:function that loads a custom model (see docs/models.md); the --model of that NAME (without NAME: the first) is passed to it. Repeatable.")] = msgspec.field(default_factory=list)
    model_devices: Annotated[list[str], Meta(description="NAME=DEVICE[,DEVICE]: the devices of one model, instead of --device/--devices (repeatable).")] = msgspec.field(default_factory=list)
    trust_remote_code: Annotated[bool, Meta(description="Run the modelling code a checkpoint ships with it (transformers' trust_remote_code). Only for checkpoints you trust.")] = False
    device: Annotated[str, Meta(description="cuda, cuda:1, mps or cpu. Default: the best available.")] | None = None
    devices: Annotated[list[str], Meta(extra={"split": ","}, description="Several devices, one worker and model copy each: cuda:0,cuda:1. Default: every GPU, else --device.")] = msgspec.field(default_factory=list)
    dtype: Annotated[str, Meta(description="float32, float16 or bfloat16. Default: bfloat16 on CUDA, else float32.")] | None = None
    # backends/workers.py: torch_threads.
    torch_threads: Annotated[int, Meta(ge=1, description="torch's intra-op threads (inter-op: 1). Default: OMP_NUM_THREADS if set, else one less than the cores this process may use (at least 1), so that the event loop keeps a core and a busy machine does not collapse throughput.")] | None = None
    cache_dir: Annotated[str, Meta(description="Where converted models are kept. Default: the user cache folder.")] | None = None
    tools: Annotated[list[str], Meta(description="Import a module of user tools (repeatable).")] = msgspec.field(default_factory=list)
    # gateway/models/sae.py
    sae: Annotated[list[str], Meta(extra={"path": "file"}, description="A sparse autoencoder: a .safetensors file with a .json or .toml sidecar (repeatable; adds the sae_* tools).")] = msgspec.field(default_factory=list)
    # gateway/plumbing/drain.py, backends/workers.py
    drain_timeout: Annotated[float, Meta(ge=0, description="On SIGTERM: seconds jobs in flight may finish before they end with shutting_down (with a shared store, a job that can go on from its checkpoint goes on in another replica instead).")] = 30.0
    job_timeout: Annotated[float, Meta(ge=0, description="Seconds a job may run before it ends with error timeout and its work is stopped (0: no limit).")] = 600.0
    queue_size: Annotated[int, Meta(ge=1, description="Jobs that may wait; more get 429 queue_full.")] = 64
    # backends/queue.py
    class_min_share: Annotated[float, Meta(ge=0, le=0.5, description="Of the jobs a queue starts, the least a lower class of users gets while it has jobs waiting (higher classes are served first; 0: strictly by class).")] = 0.1
    max_queued_per_owner: Annotated[int, Meta(ge=1, description="Jobs one owner (a token; without tokens, a client address) may have waiting; more get 429 rate_limited. Default: half of --queue-size, rounded up.")] | None = None
    max_batch_size: Annotated[int, Meta(ge=1, description="Most jobs of one tool run together (1: no batching).")] = 32
    max_decoding_jobs: Annotated[int, Meta(ge=1, description="Most generate jobs decoding together in one continuous batch; new ones join it up to this count and as long as the priced memory of all of them fits --max-job-memory (--max-batch-size 1 turns batching off for them too).")] = 256
    batch_wait_ms: Annotated[float, Meta(ge=0, description="How long a lone job may wait for others to batch with (not one client's next job on an idle worker).")] = 5.0
    max_prompts: Annotated[int, Meta(ge=1, description="Most prompts in one job.")] = 32
    max_tokens: Annotated[int, Meta(ge=1, description="Most tokens one generate job may ask for.")] = 512
    max_sequences: Annotated[int, Meta(ge=1, description="Most texts or sequences in one embed or pseudo_loglikelihood job.")] = 4096
    max_body_bytes: Annotated[int, Meta(ge=1)] = 1 << 20
    # gateway/cost.py
    max_job_memory: Annotated[int, Meta(ge=1, extra=BYTES, description="Most memory one job may hold at its peak beyond the weights (activations, attention, states and logits kept, its result), as its tool prices it before queueing; more get 413 too_large naming the field to shrink. Batches are cut to fit it too. Default: a quarter of --engine-memory-limit when that is given (more than half of it is refused); else half the smallest GPU's memory, else a quarter of this machine's.")] | None = None
    max_result_bytes: Annotated[int, Meta(ge=1, extra=BYTES, description="Most bytes of one job's result (JSON), as priced before queueing; more get 413 too_large.")] = DEFAULT_RESULT_BYTES
    max_result_file_bytes: Annotated[int, Meta(ge=0, extra=BYTES, description="Most bytes of the files one job writes beside its result (a per-position array as safetensors or npy, feature tracks as bigWig and BED, scores as TSV), as priced before queueing; more get 413 too_large. A per-position result over --max-result-bytes is written as files when its tool can, within this. 0: no result files.")] = DEFAULT_FILE_BYTES
    max_checkpoint_bytes: Annotated[int, Meta(ge=0, extra=BYTES, description="Most bytes on disk of one job's checkpoint journal (what a windowed or chunked job has finished, kept so that it goes on from there after its engine or gateway stops), as priced before queueing and held with its results in --result-store-bytes. A job priced over it runs without one (after a crash it starts again from nothing); a journal that grows past it is kept no further. 0: no checkpoints.")] = DEFAULT_JOURNAL_BYTES
    # gateway/plumbing/slowclients.py
    max_header_bytes: Annotated[int, Meta(ge=1024, description="Most bytes of a request's line and headers together; more get 431 headers_too_large and the connection is closed.")] = 64 * 1024
    # gateway/plumbing/sendbuffer.py
    send_buffer: Annotated[int, Meta(ge=1, extra=BYTES, description="Bytes the kernel may hold unsent for each connection (SO_SNDBUF; Linux doubles it for its bookkeeping): with a piece of a big event and 64 KiB more, what a client that stops reading keeps until --write-timeout cuts it. It also bounds a stream's bytes per round trip: 512 KiB carries about 5 MB/s at a 100 ms round trip; raise it for big results to distant clients.")] = 512 * 1024
    # gateway/plumbing/slowclients.py, then gateway/params.py
    header_timeout: Annotated[float, Meta(ge=1, description="Seconds a request's line and headers may take to arrive (from connecting, or from the first byte of the next request on a kept-alive connection) before 408 request_timeout and the connection is closed. Real clients send them in one round trip; 10 s allows very slow links yet stops a client that trickles them to hold a connection.")] = 10.0
    body_timeout: Annotated[float, Meta(ge=1, description="Seconds a request body may take to arrive in full after its headers before 408 request_timeout; no job is created. 30 s carries the default 1 MiB body at 35 KB/s.")] = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # gateway/plumbing/logs.py
    log_format: Annotated[Literal["text", "json"], Meta(description="Log lines as text, or as one JSON object each (with request_id, job_id).")] = "text"
    debug: Annotated[bool, Meta(description="Put tracebacks in tool_error messages.")] = False
    executor_token: Annotated[str, Meta(description="The bearer token shared by gateways and executors.")] | None = None

    # The gateway's (`serve`).
    backend: Annotated[Literal["local", "remote", "ray"], Meta(extra=SERVE, description="Run tools in this process, on executors, or on the replicas of a Ray Serve application.")] = "local"
    # backends/engines.py
    engine: Annotated[Literal["thread", "process"], Meta(extra=SERVE, description="For --backend local: each model in an engine process of its own that the gateway restarts if it dies (a crash, an out-of-memory kill, a failed device) while the gateway and the other models go on; or all of them on threads of this process.")] = "process"
    engine_memory_limit: Annotated[int, Meta(ge=1, extra={**SERVE, **BYTES}, description="For --engine process: the most address space each engine may take (RLIMIT_AS); a job that would pass it fails alone instead of exhausting the host. Leave room for the weights, torch's own reservations and the allocator's arenas. --max-job-memory follows from it (a quarter, by default).")] | None = None
    # backends/inference.py
    vllm_python: Annotated[str, Meta(extra=SERVE, description="For --model NAME=vllm:PATH: the Python of vLLM's environment. Default: the project's .vllm (make vllm).")] | None = None
    vllm_args: Annotated[str, Meta(extra=SERVE, description='For --model NAME=vllm:PATH: more flags for each vLLM server, as one string ("--max-model-len 2048 --gpu-memory-utilization 0.8").')] = ""
    vllm_kv_cache_bytes: Annotated[int, Meta(ge=1, extra={**SERVE, **BYTES}, description="For --model NAME=vllm:PATH: the KV cache each vLLM server holds (vLLM's --kv-cache-memory-bytes), its memory budget beside the weights, whatever else the machine runs. Default: 2 GiB on a CPU (vLLM's own default takes 92% of the host's memory and refuses to start beside other work); on a GPU, vLLM's own sizing. --vllm-args with --kv-cache-memory-bytes or --gpu-memory-utilization overrides it.")] | None = None
    model_api_key: Annotated[list[str], Meta(extra=SERVE, description="NAME=ENV_VAR: the environment variable holding the API key of the openai+ model NAME (repeatable). Default: OPENAI_API_KEY.")] = msgspec.field(default_factory=list)
    # backends/ray_serve.py
    ray_address: Annotated[str, Meta(extra=SERVE, description="For --backend ray: the Ray cluster, from one of its nodes (auto, or HEAD:6379); default: start or join a local one.")] | None = None
    ray_replicas: Annotated[int, Meta(ge=1, extra=SERVE, description="For --backend ray: how many model replicas (default 1).")] | None = None
    ray_min_replicas: Annotated[int, Meta(ge=1, extra=SERVE, description="For --backend ray: scale on ongoing requests, from this many replicas…")] | None = None
    ray_max_replicas: Annotated[int, Meta(ge=1, extra=SERVE, description="…to this many.")] | None = None
    ray_gpus_per_replica: Annotated[float, Meta(ge=0, extra=SERVE, description="For --backend ray: GPUs each replica takes (default 1 when the cluster has GPUs, else 0).")] | None = None
    ray_cpus_per_replica: Annotated[float, Meta(ge=0, extra=SERVE, description="For --backend ray: CPUs each replica takes.")] = 1.0
    executors: Annotated[list[str], Meta(extra={**SERVE, "flag": "executor"}, description="An executor's URL, for --backend remote (repeatable).")] = msgspec.field(default_factory=list)
    executor_deadline: Annotated[float, Meta(ge=0, extra=SERVE, description="Seconds an executor may be unreachable before its jobs end with backend_unavailable.")] = 30.0
    detach_grace: Annotated[float, Meta(ge=0, extra=SERVE, description="Seconds a job runs on with no client attached before it is cancelled (0: cancel on disconnect).")] = 30.0
    retention: Annotated[float, Meta(ge=0, extra=SERVE, description="Seconds a finished job and its events stay readable.")] = 600.0
    max_finished_jobs: Annotated[int, Meta(ge=1, extra=SERVE, description="Finished jobs the memory store keeps within --retention (each a few KB beside its log); past it the oldest are forgotten early (404).")] = 10_000
    # gateway/plumbing/spool.py, gateway/server/store.py
    result_store_bytes: Annotated[int, Meta(ge=1, extra={**SERVE, **BYTES}, description="Most bytes of finished results kept in the result spool on disk; a job whose priced result would not fit beside them and the running jobs' is refused before it is queued (503 overloaded, with Retry-After). Default: half the spool folder's free space at start.")] | None = None
    result_spool: Annotated[str, Meta(extra=SERVE, description="The folder of the result spool: results of 64 KiB or more (and any result, past --result-memory-bytes) are written there once, as unnamed files that vanish with the process, and read from there by every reader. Default: the system's temporary folder.")] | None = None
    result_memory_bytes: Annotated[int, Meta(ge=0, extra={**SERVE, **BYTES}, description="Most bytes of finished jobs' events held in memory with --store memory; past it every new result goes to the result spool.")] = 64 << 20
    # gateway/server/redis_store/
    store: Annotated[str, Meta(pattern=r"^(memory$|rediss?://|unix://)", extra={**SERVE, "expected": "memory, or a Redis URL: redis://host:port/db (rediss://, unix://)"}, description="Where jobs are kept: memory (this process), or redis://host:port/db, shared by every replica.")] = "memory"
    store_outage_grace: Annotated[float, Meta(ge=1, extra=SERVE, description="Seconds a Redis store may be unreachable while jobs run on and their events wait for it; also how long a silent replica counts as alive.")] = 30.0
    ping_interval: Annotated[float, Meta(ge=0, extra=SERVE, description="Seconds of quiet before a ': ping' comment (0: none).")] = 15.0
    # gateway/server/stream.py
    max_streams: Annotated[int, Meta(ge=1, extra=SERVE, description="Event streams held at once; past it new streams get 503 overloaded with Retry-After (each takes a file descriptor and ~45 KB).")] = 10_000
    max_streams_per_owner: Annotated[int, Meta(ge=1, extra=SERVE, description="Event streams one owner (a token; without tokens, a client address) may hold; more get 429 rate_limited. Default: no limit but --max-streams.")] | None = None
    retry_ms: Annotated[int, Meta(ge=0, extra=SERVE, description="The reconnect delay sent to EventSource clients.")] = 3000
    # gateway/server/auth.py: no tokens, no auth.
    tokens_file: Annotated[str, Meta(extra={**SERVE, "path": "existing file"}, description="A TOML file of client tokens ([tokens.<name>] token, tools, max_concurrent, jobs_per_minute, weight, admin). With tokens, runs need a bearer token.")] | None = None
    tokens: Annotated[list[str], Meta(extra=SERVE, description="Client tokens as name=token (repeatable; prefer the env var: a command line is visible to other users).")] = msgspec.field(default_factory=list)
    max_concurrent_per_token: Annotated[int, Meta(ge=1, extra=SERVE, description="Jobs one token may run at once (429 rate_limited past it).")] | None = None
    jobs_per_minute_per_token: Annotated[int, Meta(ge=1, extra=SERVE, description="Jobs one token may start per minute (429 rate_limited past it).")] | None = None
    ticket_ttl: Annotated[float, Meta(ge=1, le=60, extra=SERVE, description="Seconds a ticket from POST /auth/ticket is valid.")] = 60.0
    # gateway/server/signin.py
    oidc_issuer: Annotated[str, Meta(extra=SERVE, description="An OpenID Connect issuer's URL: bearer JWTs it signs are accepted beside the tokens, checked against its keys (its discovery document's jwks_uri). Needs --oidc-audience.")] | None = None
    oidc_audience: Annotated[str, Meta(extra=SERVE, description="The audience (aud) a JWT must name: this gateway's client id at the issuer.")] | None = None
    oidc_jwks_url: Annotated[str, Meta(extra=SERVE, description="Where the issuer's keys (JWKS) are, instead of its discovery document's jwks_uri.")] | None = None
    oidc_tenant_claim: Annotated[str, Meta(min_length=1, extra=SERVE, description="The JWT claim naming the user, whose jobs and limits are theirs (sub, email, preferred_username…).")] = "sub"
    oidc_groups_claim: Annotated[str, Meta(min_length=1, extra=SERVE, description="The JWT claim listing the user's groups.")] = "groups"
    oidc_algorithms: Annotated[list[str], Meta(extra={**SERVE, "split": ","}, description="The signature algorithms a JWT may use, comma-separated; asymmetric ones only.")] = msgspec.field(default_factory=lambda: ["RS256", "PS256", "ES256", "EdDSA"])
    oidc_jwks_refresh: Annotated[float, Meta(ge=10, extra=SERVE, description="Seconds after which the issuer's keys are fetched again (also at once for a key id they lack, at most every 10 s).")] = 300.0
    # gateway/server/webhooks.py
    webhook_secret: Annotated[str, Meta(extra=SERVE, description="The Standard Webhooks secret (whsec_ and base64) completion webhooks are signed with; with it, a run may name a Callback-URL (prefer the env var).")] | None = None
    callback_hosts: Annotated[list[str], Meta(extra={**SERVE, "split": ","}, description="The hosts a Callback-URL may name, comma-separated (exact, or *.domain); none given: any public host. A private or loopback address only when listed exactly.")] = msgspec.field(default_factory=list)
    webhook_attempts: Annotated[int, Meta(ge=1, le=30, extra=SERVE, description="Tries to deliver a completion webhook, apart by a backoff from 1 s doubling up to 10 minutes.")] = 10
    webhook_timeout: Annotated[float, Meta(gt=0, le=60, extra=SERVE, description="Seconds a webhook receiver has to answer one try.")] = 10.0
    webhooks_per_tenant: Annotated[int, Meta(ge=1, le=10_000, extra=SERVE, description="Completion webhooks one tenant may have open (its jobs' that run, and those still being tried); a run naming a Callback-URL past it gets 429.")] = 64
    write_timeout: Annotated[float, Meta(ge=1, extra=SERVE, description="Seconds a stream's write may block (a half-open connection) before the client is detached.")] = 30.0
    cors_origins: Annotated[list[str], Meta(extra={**SERVE, "split": ","}, description="Origins allowed to call from a browser, comma-separated (none by default).")] = msgspec.field(default_factory=list)

    # The executor's (`executor`).
    result_ttl: Annotated[float, Meta(ge=0, extra=EXECUTOR, description="Seconds a finished job's result is kept if nobody fetches it.")] = 600.0
    session_grace: Annotated[float, Meta(ge=0, extra=EXECUTOR, description="Seconds a gateway's jobs run on without its socket before they are cancelled.")] = 30.0

    def limits(self) -> dict[str, int]:
        """Server limits that tools bind their fields to through `Tool.caps`."""
        return {"max_prompts": self.max_prompts, "max_tokens": self.max_tokens, "max_sequences": self.max_sequences}


class SettingsError(ValueError):
    """A setting refused, in words that name where it came from."""


def build(values: Mapping[str, Any]) -> Settings:
    """Settings from values keyed by field name (any not given: its default), checked.

    The one validation every source ends in: the Struct's types and ranges, then the rules between
    settings, which no single flag's check can see.
    """
    try:
        settings = msgspec.convert(values, Settings)
    except msgspec.ValidationError as exc:
        raise SettingsError(str(exc)) from None
    if settings.ray_replicas is not None and (settings.ray_min_replicas, settings.ray_max_replicas) != (None, None):
        raise SettingsError("give --ray-replicas, or --ray-min-replicas/--ray-max-replicas, not both")
    if settings.backend == "ray" and (settings.ray_address or "").startswith("ray://"):
        raise SettingsError(
            "--ray-address ray://… (Ray Client) cannot stream from Serve: run the gateway on a node of the "
            "cluster (ray start --address HEAD:6379) and give --ray-address auto"
        )
    if settings.backend == "remote" and not settings.executors:
        raise SettingsError("--backend remote needs at least one --executor URL")
    if (limit := settings.engine_memory_limit) is not None:
        # An engine holds its weights, torch's reservations and its allocator's arenas besides a job:
        # a job priced at more than half its address space would pass the limit mid-pass.
        if settings.max_job_memory is None:
            settings.max_job_memory = limit // ENGINE_SHARE
        elif settings.max_job_memory > limit // 2:
            raise SettingsError(
                f"--max-job-memory ({settings.max_job_memory}) is more than half of --engine-memory-limit ({limit}): "
                "a job priced that high would pass the engine's limit beside its weights; lower it, or leave it out "
                f"to have a {ENGINE_SHARE}th of the limit"
            )
    return settings


# -- each field as the CLI and the decoders see it -------------------------------------------


class Setting(msgspec.Struct, frozen=True):
    """One field of Settings as its type, Meta and extra say, unwrapped."""

    name: str
    kind: Any  # int, float, bool or str: the value's, or each item's of a list
    listed: bool
    default: Any
    help: str | None
    ge: float | None
    le: float | None
    choices: tuple[str, ...] | None
    pattern: str | None
    extra: dict[str, Any]

    @property
    def flag(self) -> str:
        return str(self.extra.get("flag", self.name.replace("_", "-")))

    @property
    def key(self) -> str:
        """The flag's name as a key of a config file, dashes made underscores (the field's own is one too)."""
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return "STREAMGATE_" + self.key.upper()

    @property
    def range(self) -> str:
        """`ge` and `le` as click writes a range: x>=1, x<=60, 1<=x<=60."""
        if self.le is None:
            return f"x>={self.ge}"
        return f"{self.ge}<=x<={self.le}" if self.ge is not None else f"x<={self.le}"

    def default_for(self, command: str) -> Any:
        return self.extra.get(f"{command}_default", self.default)

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type, in the words of the flag's own check; None: nothing."""
        for item in value if self.listed and isinstance(value, (list, tuple)) else [value]:
            if self.choices is not None and item not in self.choices:
                return f"{item!r} is not one of {', '.join(map(repr, self.choices))}."
            if (self.ge is not None and item < self.ge) or (self.le is not None and item > self.le):
                return f"{item} is not in the range {self.range}."
            if self.pattern is not None and not re.search(self.pattern, item):
                return f"expected {self.extra['expected']}"
            if self.extra.get("path") == "existing file" and not os.path.isfile(item):
                return f"File {item!r} does not exist."
        return None


def _setting(field: mi.Field) -> Setting:
    shape, found = field.type, {"help": None, "listed": False, "extra": {}}
    while True:
        if isinstance(shape, mi.Metadata):
            found["help"] = (shape.extra_json_schema or {}).get("description") or found["help"]
            found["extra"] = {**(shape.extra or {}), **found["extra"]}
            shape = shape.type
        elif isinstance(shape, mi.UnionType):  # X | None: None is "not set", never given
            shape = next(t for t in shape.types if not isinstance(t, mi.NoneType))
        elif isinstance(shape, mi.ListType):
            found["listed"], shape = True, shape.item_type
        else:
            break
    default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
    return Setting(
        name=field.name, default=default,
        kind={mi.IntType: int, mi.FloatType: float, mi.BoolType: bool}.get(type(shape), str),
        ge=getattr(shape, "ge", None), le=getattr(shape, "le", None), pattern=getattr(shape, "pattern", None),
        choices=_literal(_ANNOTATIONS[field.name]) if isinstance(shape, mi.LiteralType) else None, **found,
    )


def _literal(annotation: Any) -> tuple[str, ...] | None:
    """A Literal's values in the order declared (msgspec's are sorted): the order --help shows."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return next((found for arg in typing.get_args(annotation) if (found := _literal(arg))), None)


_ANNOTATIONS = {f.name: f.type for f in msgspec.structs.fields(Settings)}
SETTINGS = [_setting(f) for f in mi.type_info(Settings).fields]  # type: ignore[attr-defined]


def settings_of(command: str) -> list[Setting]:
    """The settings `command` (`serve` or `executor`) takes, in --help's order."""
    return [s for s in SETTINGS if s.extra.get("only", command) == command]


# -- decoding: a config file's table, a Serve config's args, STREAMGATE_* variables ---------


def decode(data: Mapping[str, Any], command: str, where: str) -> dict[str, Any]:
    """The settings a config file's table gives `command`, checked, keyed by field name.

    Keys are the fields' or their flags' names, with dashes or underscores; values have TOML's
    types, strictly (`port = "9000"` is a mistake, not a string to parse), except that one entry
    of a list needs no array and a size may have units. A key that is no setting of `command`, one
    given twice, or a value refused is a SettingsError naming `where` and the key.
    """
    mine = settings_of(command)
    keys = {s.name: s for s in mine} | {s.key: s for s in mine}
    found: dict[str, Any] = {}
    for key, value in data.items():
        setting = keys.get(key.replace("-", "_"))
        if setting is None:
            raise SettingsError(_unknown(key, command, where, keys))
        if setting.name in found:
            raise SettingsError(f"{where}: {key!r} sets {setting.name}, which is already set")
        found[setting.name] = _checked(setting, value, f"{where}: {key}", strict=True)
    return found


def environ(command: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings `STREAMGATE_*` variables give `command`, checked, keyed by field name.

    The CLI reads these through its generated options; this is for what is built without it
    (backends/ray_app.py). As on the command line, an empty variable is not set.
    """
    found = {}
    for setting in settings_of(command):
        text = env.get(setting.env)
        if text:
            if setting.listed and "split" not in setting.extra:
                text = split(text, setting.extra.get("env_split"))
            found[setting.name] = _checked(setting, text, setting.env, strict=False)
    return found


def _checked(setting: Setting, value: Any, where: str, strict: bool) -> Any:
    if setting.listed and not isinstance(value, list):  # one entry needs no array
        sep = setting.extra.get("split")
        value = split(value, sep) if sep and isinstance(value, str) else [value]
    elif setting.extra.get("unit") == "bytes" and isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as exc:
            raise SettingsError(f"{where}: {exc}") from None
    kind = list[setting.kind] if setting.listed else setting.kind
    try:
        value = msgspec.convert(value, kind, strict=strict)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"{where}: {exc}") from None
    problem = setting.problem(value)
    if problem is not None:
        raise SettingsError(f"{where}: {problem}")
    return value


def _unknown(key: str, command: str, where: str, keys: Mapping[str, Setting]) -> str:
    name = key.replace("-", "_")
    if any(name in (s.name, s.key) for s in SETTINGS):
        return f"{where}: {key!r} is not a setting of `streamgate {command}`"
    close = difflib.get_close_matches(name, list(keys), n=1)
    return f"{where}: unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def split(text: str, sep: str | None = ",") -> list[str]:
    """The entries `text` lists at `sep` (None: at whitespace), stripped, empty ones dropped."""
    return [item.strip() for item in text.split(sep) if item.strip()]


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """A size in bytes from 1048576, 512MiB, 8GiB, 4G (1024-based); ValueError if it is none."""
    plain = text.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = (plain[:-1], plain[-1]) if plain.endswith(tuple("kmgt")) else (plain, "")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with KiB, MiB, GiB") from None
