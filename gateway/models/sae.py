"""A user's sparse autoencoder (SAE): reading it from disk, checking it, encoding and decoding.

An SAE is a safetensors file with `W_enc` (d_model × n_features), `b_enc`
(n_features), `W_dec` (n_features × d_model), `b_dec` (d_model) and, for
JumpReLU, `threshold` (n_features), plus a sidecar next to it with the same
stem (`.json` or `.toml`):

    {"layer": 6, "activation": "topk", "k": 32, "name": "res6", "labels": {"12": "dogs"}}

`layer` is the decoder block whose output (the residual stream, as
`gateway/models/anatomy.py` numbers the blocks) the SAE reads; `activation` is
`topk` (with `k`), `relu` or `jumprelu`; `labels` is a list (by feature id)
or a `{id: label}` table; `apply_b_dec_to_input` subtracts `b_dec` before
encoding, as some trainers do.

Checking happens in two steps so that a bad file fails as early as it can:
`read_spec` reads the sidecar and the safetensors header only (names, shapes)
when the backend is built; `load` reads the tensors (NaN/inf) and checks them
against the loaded model (d_model, layer count) right after the model loads.
Every error is an `SAEError` naming the file and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from gateway.models.base import Capability

ACTIVATIONS = ("topk", "relu", "jumprelu")


class SAEError(ValueError):
    """An SAE file, its sidecar, or its fit to the model is wrong."""


class Sidecar(msgspec.Struct, forbid_unknown_fields=True):
    layer: Annotated[int, msgspec.Meta(ge=0)]
    activation: Literal["topk", "relu", "jumprelu"]
    k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    name: Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] | None = None
    labels: list[str] | dict[str, str] | None = None
    apply_b_dec_to_input: bool = False


@dataclass(frozen=True)
class SAESpec:
    """What an SAE's files say, checked without reading its tensors."""

    path: Path
    name: str
    layer: int
    activation: str
    k: int | None
    d_model: int
    n_features: int
    labels: dict[int, str] = field(default_factory=dict)
    apply_b_dec_to_input: bool = False


def read_specs(paths: list[str]) -> list[SAESpec]:
    """The specs of every `--sae` file; two SAEs with one name is an error."""
    specs = [read_spec(Path(p)) for p in paths]
    seen: dict[str, Path] = {}
    for spec in specs:
        if spec.name in seen:
            raise SAEError(
                f"--sae {spec.path}: the name {spec.name!r} is also used by {seen[spec.name]}; "
                "give one of them another `name` in its sidecar"
            )
        seen[spec.name] = spec.path
    return specs


def read_spec(path: Path) -> SAESpec:
    def fail(problem: str) -> SAEError:
        return SAEError(f"--sae {path}: {problem}")

    if not path.is_file():
        raise fail("no such file")
    sidecar = _read_sidecar(path, fail)
    shapes = _header_shapes(path, fail)
    missing = [n for n in ("W_enc", "b_enc", "W_dec", "b_dec") if n not in shapes]
    if sidecar.activation == "jumprelu" and "threshold" not in shapes:
        missing.append("threshold (needed by jumprelu)")
    if missing:
        raise fail(f"missing tensors: {', '.join(missing)} (it has {', '.join(sorted(shapes)) or 'none'})")
    w_enc = shapes["W_enc"]
    if len(w_enc) != 2:
        raise fail(f"W_enc must be d_model × n_features; its shape is {list(w_enc)}")
    d_model, n = w_enc
    wanted = {"b_enc": (n,), "W_dec": (n, d_model), "b_dec": (d_model,), "threshold": (n,)}
    for name, shape in wanted.items():
        if name in shapes and tuple(shapes[name]) != shape:
            raise fail(
                f"{name} has shape {list(shapes[name])}, but W_enc {list(w_enc)} means it must be {list(shape)}"
            )
    if sidecar.activation == "topk":
        if sidecar.k is None:
            raise fail("the sidecar says activation topk but gives no k")
        if sidecar.k > n:
            raise fail(f"k = {sidecar.k} is more than the SAE's {n} features")
    labels = _labels(sidecar.labels, n, fail)
    return SAESpec(
        path=path,
        name=sidecar.name or path.stem,
        layer=sidecar.layer,
        activation=sidecar.activation,
        k=sidecar.k,
        d_model=d_model,
        n_features=n,
        labels=labels,
        apply_b_dec_to_input=sidecar.apply_b_dec_to_input,
    )


def _read_sidecar(path: Path, fail: Any) -> Sidecar:
    found = [p for p in (path.with_suffix(".json"), path.with_suffix(".toml")) if p.is_file()]
    if not found:
        raise fail(f"no sidecar: expected {path.with_suffix('.json').name} or {path.with_suffix('.toml').name} next to it")
    if len(found) > 1:
        raise fail(f"two sidecars ({found[0].name}, {found[1].name}): keep one")
    sidecar = found[0]
    decode = msgspec.json.decode if sidecar.suffix == ".json" else msgspec.toml.decode
    try:
        return decode(sidecar.read_bytes(), type=Sidecar)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise fail(f"sidecar {sidecar.name}: {exc}") from None


def _header_shapes(path: Path, fail: Any) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise fail(f"not a readable safetensors file: {exc}") from None


def _labels(raw: list[str] | dict[str, str] | None, n: int, fail: Any) -> dict[int, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        if len(raw) > n:
            raise fail(f"the sidecar has {len(raw)} labels for {n} features")
        return {i: label for i, label in enumerate(raw) if label}
    labels = {}
    for key, label in raw.items():
        try:
            i = int(key)
        except ValueError:
            raise fail(f"label key {key!r} is not a feature id") from None
        if not 0 <= i < n:
            raise fail(f"label key {key} is out of range: the SAE has {n} features (0..{n - 1})")
        labels[i] = label
    return labels


class SAE:
    """An SAE's tensors on one device, in float32; encode and decode residual-stream vectors."""

    def __init__(self, spec: SAESpec, tensors: dict[str, Any], device: Any) -> None:
        self.spec = spec
        self.W_enc = tensors["W_enc"].float().to(device)
        self.b_enc = tensors["b_enc"].float().to(device)
        self.W_dec = tensors["W_dec"].float().to(device)
        self.b_dec = tensors["b_dec"].float().to(device)
        threshold = tensors.get("threshold")
        self.threshold = threshold.float().to(device) if threshold is not None else None
        self.decoder_norms = self.W_dec.norm(dim=-1).cpu()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n_features(self) -> int:
        return self.spec.n_features

    def encode(self, x: Any) -> Any:
        """Feature activations (…, n_features) of residual vectors (…, d_model)."""
        import torch

        x = x.float()
        if self.spec.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.spec.activation == "relu":
            return torch.relu(pre)
        if self.spec.activation == "jumprelu":
            return pre * (pre > self.threshold)
        values, ids = torch.topk(pre, self.spec.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, ids, torch.relu(values))

    def decode(self, f: Any) -> Any:
        return f @ self.W_dec + self.b_dec


def load(spec: SAESpec, model: Any) -> SAE:
    """Read the tensors and check them and the spec against the loaded `model` (a tools `Model`)."""
    import torch
    from safetensors.torch import load_file

    from gateway.models.anatomy import ModelShapeError, anatomy

    def fail(problem: str) -> SAEError:
        return SAEError(f"--sae {spec.path}: {problem}")

    try:
        n_layers = anatomy(model).n_layers
    except ModelShapeError as exc:
        raise fail(f"the model's layers cannot be read: {exc}") from None
    hidden = model.memo.get("layer_width")
    if hidden is not None and spec.d_model != hidden:
        raise fail(f"d_model is {spec.d_model} (W_enc's first dimension) but the model's hidden size is {hidden}")
    if spec.layer >= n_layers:
        raise fail(f"layer {spec.layer} is out of range: the model has {n_layers} layers (0..{n_layers - 1})")
    tensors = load_file(str(spec.path))
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        t = tensors.get(name)
        if t is None:
            continue
        if not t.is_floating_point():
            raise fail(f"{name} has dtype {t.dtype}; it must be floating point")
        if not bool(torch.isfinite(t).all()):
            raise fail(f"{name} has NaN or infinite values")
    return SAE(spec, tensors, model.device)


def attach(model: Any, specs: list[SAESpec]) -> None:
    """Load every SAE for `model` and keep them on it, by name, for the SAE tools."""
    model.saes = {spec.name: load(spec, model) for spec in specs}
    if model.saes:
        model.capabilities = model.capabilities | {Capability.SAE}
    else:
        model.missing[Capability.SAE] = "no SAE is loaded on it (--sae gives the default model its SAEs)"
