"""Shared fixtures: a tiny random model on disk, and real uvicorn servers on loopback."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from backends.local import LocalBackend
from backends.remote import RemoteBackend
from gateway.app import create_app
from gateway.config import Settings
from gateway.tools import Tool, builtin_tools, collect

TINY_CONTEXT = 256


# The families `build_tiny_model` can make, each from a tiny config; see `_tiny_config`.
FAMILIES = ("llama", "gpt2", "gpt_neox", "qwen2", "gemma", "gemma2")
TINY_SOFTCAP = 5.0  # gemma2's final_logit_softcapping: small, so that it changes the numbers


def byte_tokenizer() -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """A byte-level tokenizer (one token per byte, then <s> </s> <pad>) that prepends <s>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    return tokenizer, vocab


def _tiny_config(family: str, vocab: dict[str, int], layers: int, init: float | None) -> tuple[Any, type]:
    """A tiny config of `family` (hidden 32, 4 heads, context TINY_CONTEXT) and its causal-LM class.

    Heads are tied to the input embeddings in gpt2, gemma and gemma2 (as in those
    families' real checkpoints) and separate in llama, gpt_neox and qwen2.
    """
    import transformers as tf

    ids = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["<pad>"]}
    extra: dict[str, Any] = {} if init is None else {"initializer_range": init}
    common = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=TINY_CONTEXT, **ids, **extra,
    )
    if family == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False), tf.LlamaForCausalLM
    if family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=len(vocab), n_embd=32, n_inner=64, n_layer=layers, n_head=4, n_positions=TINY_CONTEXT,
            tie_word_embeddings=True, **ids, **extra,
        )
        return config, tf.GPT2LMHeadModel
    if family == "gpt_neox":
        # Parallel attention + MLP residual and partial rotary, as in Pythia.
        return tf.GPTNeoXConfig(**common, tie_word_embeddings=False, use_parallel_residual=True), tf.GPTNeoXForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    if family == "gemma":
        return tf.GemmaConfig(**common, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True), tf.GemmaForCausalLM
    if family == "gemma2":
        config = tf.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, tie_word_embeddings=True,
            final_logit_softcapping=TINY_SOFTCAP,
        )
        return config, tf.Gemma2ForCausalLM
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build_tiny_model(
    path: Path, *, seed: int = 0, family: str = "llama", layers: int = 2, init: float | None = None
) -> Path:
    """A tiny random causal LM with a byte-level tokenizer (one token per byte), saved at `path`.

    By default a 2-layer Llama; `family` picks another of FAMILIES (same tokenizer,
    hidden size 32, context TINY_CONTEXT), `layers` its depth and `init` its
    `initializer_range` (larger weights: peakier, less tie-prone distributions).

    Its EOS row of the output head is zero, so greedy decoding never ends early by
    chance: tests that need EOS say which token it is. Where the head is tied to the
    input embeddings (gpt2, gemma, gemma2) the shared row is zeroed, which also
    zeroes EOS's input embedding; no prompt ever contains EOS, so only its logit changes.
    """
    tokenizer, vocab = byte_tokenizer()
    config, model_class = _tiny_config(family, vocab, layers, init)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[vocab["</s>"]] = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=FAMILIES)
def arch_model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of each family in FAMILIES, built once per session (init 0.2, 2 layers; gemma2 3)."""
    family = request.param
    layers = 3 if family == "gemma2" else 2  # gemma2: sliding and global attention layers both
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, layers=layers, init=0.2)


@dataclass
class Server:
    """A gateway running under uvicorn on a free loopback port, in a thread of its own."""

    app: Any
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    events: list[Any] = field(default_factory=list)

    @property
    def backend(self) -> Any:
        return self.app.state.backend

    def start(self) -> Server:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout: float = 60) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/readyz").status_code == 200:
                return self
            time.sleep(0.05)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def make_server(
    model_path: Path | str | None, *, tools: list[Tool] | None = None, ready: bool = True, **settings: Any
) -> Server:
    settings_obj = Settings(model=str(model_path) if model_path else None, **settings)
    backend = LocalBackend(
        collect(builtin_tools() + (tools or [])),
        model=settings_obj.model,
        device="cpu",
        queue_size=settings_obj.queue_size,
        debug=settings_obj.debug,
        cache_dir=settings_obj.cache_dir,
    )
    server = Server(create_app(backend, settings_obj)).start()
    return server.wait_ready() if ready else server


def make_remote_server(
    executors: list[str], *, token: str | None = None, deadline: float = 30.0, ready: bool = True, **settings: Any
) -> Server:
    """A gateway with the remote backend, in this process, driving real executor processes."""
    backend = RemoteBackend(executors, token=token, deadline=deadline, poll_interval=0.2)
    server = Server(create_app(backend, Settings(backend="remote", executors=executors, **settings))).start()
    return server.wait_ready() if ready else server


@pytest.fixture
def serve(tiny_model_path: Path) -> Iterator[Any]:
    """Start servers on the tiny model: `serve(tools=[...], queue_size=2, ...)`; stopped after the test."""
    started: list[Server] = []

    def start(**kwargs: Any) -> Server:
        kwargs.setdefault("model_path", tiny_model_path)
        server = make_server(kwargs.pop("model_path"), **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    """One shared server on the tiny model with the built-in tools."""
    s = make_server(tiny_model_path)
    yield s
    s.stop()


@dataclass
class Stream:
    """A finished SSE response: status, headers, raw bytes, and the parsed events."""

    status: int
    headers: httpx.Headers
    raw: bytes
    events: list[dict[str, Any]]

    def of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == type]

    @property
    def terminal(self) -> dict[str, Any]:
        return self.events[-1]

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """A WHATWG-conformant SSE parse of a complete stream (fields per event, comments dropped)."""
    text = raw.decode("utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    data: list[str] = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                current["data"] = json.loads("\n".join(data))
                current.setdefault("event", "message")
                events.append(current)
            current, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name in ("event", "id", "retry"):
            current[name] = value
    return events


def run_stream(url: str, tool: str, params: Any = None, *, method: str = "POST", query: Any = None,
               headers: dict[str, str] | None = None, content: bytes | None = None, timeout: float = 60) -> Stream:
    with httpx.Client(timeout=timeout) as client:
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if method == "POST":
            if content is not None:
                kwargs["content"] = content
            else:
                kwargs["json"] = params
        else:
            kwargs["params"] = query
        with client.stream(method, f"{url}/{tool}/run", **kwargs) as response:
            raw = response.read()
    is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
    return Stream(response.status_code, response.headers, raw, parse_sse(raw) if is_sse else [])


@contextlib.contextmanager
def open_stream(url: str, tool: str, params: Any) -> Iterator[httpx.Response]:
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/{tool}/run", json=params) as response:
            yield response


def track_jobs(server: Server) -> dict[str, Any]:
    """Record every job the backend accepts, by id (the gateway keeps no registry)."""
    jobs: dict[str, Any] = {}
    submit = server.backend.submit

    async def recording_submit(job: Any) -> None:
        await submit(job)
        jobs[job.id] = job

    server.backend.submit = recording_submit
    return jobs


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)
