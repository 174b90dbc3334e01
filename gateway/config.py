"""Server settings: one Struct, filled from `streamgate serve` flags or `STREAMGATE_*` variables."""

from __future__ import annotations

import msgspec

from gateway.cost import DEFAULT_RESULT_BYTES


class Settings(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # [NAME=]SOURCE each; the first is the default model; none: the bundled one (backends/loading.py).
    model: list[str] = msgspec.field(default_factory=list)
    # [NAME=]module:function each, returning a custom model (gateway/models/custom.py).
    model_loader: list[str] = msgspec.field(default_factory=list)
    model_devices: list[str] = msgspec.field(default_factory=list)  # NAME=DEVICE[,DEVICE] each
    trust_remote_code: bool = False
    device: str | None = None
    devices: list[str] = msgspec.field(default_factory=list)
    dtype: str | None = None
    # torch's intra-op threads (backends/workers.py: torch_threads); None: OMP_NUM_THREADS, else cores - 1.
    torch_threads: int | None = None
    cache_dir: str | None = None
    tools: list[str] = msgspec.field(default_factory=list)
    sae: list[str] = msgspec.field(default_factory=list)  # SAE files (gateway/models/sae.py)
    queue_size: int = 64
    # Jobs one tenant (token, or client address) may have waiting; None: half of queue_size (backends/queue.py).
    max_queued_per_owner: int | None = None
    max_batch_size: int = 32
    # Jobs of a continuous batch (generate) decoding together: bounded by their priced memory (max_job_memory) first.
    max_decoding_jobs: int = 256
    batch_wait_ms: float = 5.0
    max_prompts: int = 32
    max_tokens: int = 512
    max_sequences: int = 4096
    max_body_bytes: int = 1 << 20
    # What one job may cost (gateway/cost.py): None, a quarter of the machine's memory (half a GPU's).
    max_job_memory: int | None = None
    max_result_bytes: int = DEFAULT_RESULT_BYTES
    max_header_bytes: int = 64 * 1024  # a request line and headers, together (gateway/plumbing/slowclients.py)
    send_buffer: int = 512 * 1024  # each connection's SO_SNDBUF (gateway/plumbing/sendbuffer.py)
    # Slow clients: seconds for a request's headers (gateway/plumbing/slowclients.py), then its body (gateway/params.py).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    ping_interval: float = 15.0
    max_streams: int = 10_000  # event streams held at once; past it 503 overloaded (gateway/server/stream.py)
    max_streams_per_owner: int | None = None  # of those, by one tenant; None: no limit of its own
    retry_ms: int = 3000
    debug: bool = False
    log_level: str = "info"
    log_format: str = "text"  # or json: one object a line (gateway/plumbing/logs.py)
    detach_grace: float = 30.0
    retention: float = 600.0
    store: str = "memory"  # or redis://host:port/db: jobs shared by every replica (gateway/server/redis_store.py)
    store_outage_grace: float = 30.0  # seconds a Redis outage is ridden out (gateway/server/redis_store.py)
    backend: str = "local"
    # --backend local: the models in this process's threads, or each in an engine process (backends/engines.py).
    engine: str = "process"
    engine_memory_limit: int | None = None  # each engine's address space (RLIMIT_AS); None: no limit
    # Models on inference servers (backends/inference.py): vLLM's interpreter (None: the project's .vllm),
    # the server's extra flags, and NAME=ENV_VAR of an `openai+` model's API key.
    vllm_python: str | None = None
    vllm_args: str = ""
    model_api_key: list[str] = msgspec.field(default_factory=list)
    executors: list[str] = msgspec.field(default_factory=list)
    # --backend ray: replicas of a Ray Serve application (backends/ray_serve.py).
    ray_address: str | None = None  # None: start or join a local Ray; "auto" or "head:6379" from a cluster's node
    ray_replicas: int | None = None  # a fixed number (default 1), or scale between the two below
    ray_min_replicas: int | None = None
    ray_max_replicas: int | None = None
    ray_gpus_per_replica: float | None = None  # None: 1 when the cluster has GPUs, else 0
    ray_cpus_per_replica: float = 1.0
    executor_token: str | None = None
    # Client access (gateway/server/auth.py): no tokens, no auth.
    tokens_file: str | None = None
    tokens: list[str] = msgspec.field(default_factory=list)
    max_concurrent_per_token: int | None = None
    jobs_per_minute_per_token: int | None = None
    ticket_ttl: float = 60.0
    cors_origins: list[str] = msgspec.field(default_factory=list)
    # Stopping and limits on one job's run (gateway/plumbing/drain.py, backends/workers.py).
    drain_timeout: float = 30.0
    job_timeout: float = 600.0
    write_timeout: float = 30.0
    executor_deadline: float = 30.0
    # The executor's own settings.
    result_ttl: float = 600.0
    session_grace: float = 30.0

    def limits(self) -> dict[str, int]:
        """Server limits that tools bind their fields to through `Tool.caps`."""
        return {"max_prompts": self.max_prompts, "max_tokens": self.max_tokens, "max_sequences": self.max_sequences}
