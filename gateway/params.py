"""From a request to a tool's params Struct, and from the Struct to JSON Schema.

Both request forms go through the same Struct: a POST body is decoded straight
into it; the GET form used by `EventSource` maps flat query keys onto fields
(repeat a key for a list) and lets msgspec coerce the strings. Server limits
named in a tool's `caps` are applied to validation and schema alike, so what
`GET /tools` advertises is exactly what is enforced. A tool that runs in another
service has no Struct here: its params travel as the request gave them
(`Relayed`), and `decode_relayed` decodes them there as this module would here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import difflib
import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
import numpy as np
from starlette.datastructures import QueryParams
from starlette.requests import Request

from gateway.errors import ApiError, ParamError, from_validation_error
from gateway.protocol import Code, ToolInfo
from gateway.tools.base import MODEL_FIELD, Tool


async def read_body(
    request: Request, limit: int, timeout: float | None = None, on_timeout: Callable[[str], None] | None = None
) -> bytes:
    """The request body, refused with 413 `too_large` as soon as it passes `limit` bytes, and
    with 408 `request_timeout` when it has not all arrived `timeout` seconds after reading
    starts, right after the headers (`on_timeout("body")` is called then, to count it)."""
    # Counted while reading, so a missing or untrue Content-Length changes nothing.
    body = bytearray()
    # One deadline for the whole body, not one per read: a client trickling a byte at a
    # time would pass any per-read limit and hold the request (never a job: params are
    # decoded only after this) for as long as it likes.
    # asyncio's timeout, not anyio's cancel scope: the same deadline for a tenth of the cost,
    # paid by every request.
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ApiError(Code.TOO_LARGE, f"the body is over the limit of {limit} bytes")
            return bytes(body)
    except TimeoutError:
        pass
    if on_timeout is not None:
        on_timeout("body")
    raise ApiError(
        Code.REQUEST_TIMEOUT,
        f"the request body did not arrive within {timeout:g} s ({len(body)} bytes came)",
        # The rest of the body may still come: the connection cannot carry another request.
        headers={"Connection": "close"},
    )


def describe(
    tools: Iterable[Tool], limits: Mapping[str, int], unsupported: Callable[[Tool], str | None] = lambda t: None
) -> list[ToolInfo]:
    """The `GET /tools` entries: JSON Schema generated from each tool's Structs, caps applied,
    and for a tool the served model cannot run, why (`unsupported`)."""
    return [
        # A tool another service published: its schemas as published, whether this model runs it from here.
        msgspec.structs.replace(t.info, unsupported=unsupported(t))
        if t.info is not None
        else ToolInfo(
            name=t.name,
            description=t.description,
            params_schema=schema(t.params, t.caps, limits),
            result_schema=schema(t.result),
            streams_partial=t.streams_partial,
            partial_schema=schema(t.partial) if t.partial else None,
            unsupported=unsupported(t),
        )
        for t in tools
    ]


# Deeper JSON than any tool's params need; deeper still would exhaust the decoder's recursion.
MAX_NESTING = 32
# A string, or an unterminated one running to the end. Possessive quantifiers and the
# unterminated ending keep this linear: each `"` starts at most one scan, which always
# matches, where a pattern that can fail rescans the rest of the body from every quote
# (`"\\` repeated took seconds for 32 KB, and grew with the square of the size).
_STRINGS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting(body: bytes) -> int:
    """How deep the JSON in `body` nests its arrays and objects (strings skipped), in time linear in its size."""
    brackets = np.frombuffer(_STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not len(brackets):
        return 0
    # `[` and `{` are 0x5b and 0x7b, `]` and `}` 0x5d and 0x7d: bit 1 tells an opening from a closing one.
    steps = (brackets & 2).astype(np.int32) - 1
    return max(int(np.cumsum(steps).max()), 0)


def check_json(body: bytes, what: str = "the body") -> None:
    """Refuse with 400 a body that is not UTF-8 or nests deeper than any params need, before it is
    decoded: msgspec's decoder recurses once per level, and a deep enough body would exhaust it."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(Code.BAD_REQUEST, f"{what} is not UTF-8") from None
    # No deeper than its count of opening brackets: most bodies are judged by two counts in C.
    if body.count(b"[") + body.count(b"{") > MAX_NESTING and (depth := nesting(body)) > MAX_NESTING:
        raise ApiError(Code.BAD_REQUEST, f"{what} nests {depth} levels deep; params may nest at most {MAX_NESTING}")


# Bodies up to this size are checked and decoded on the event loop (tens of microseconds); a bigger
# one on a thread of its own: a 1 MiB body's checks take 15-20 ms of CPU, which the loop's other
# requests would otherwise wait out. One thread, so that many big bodies queue there, not on the loop.
INLINE_BYTES = 64 * 1024
_parsing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamgate-parse")


async def off_loop(fn: Callable[..., Any], body: bytes, *args: Any) -> Any:
    """`fn(*args, body)` (a check or decode of `body`) on the event loop for a small body, else on
    the parsing thread."""
    if len(body) <= INLINE_BYTES:
        return fn(*args, body)
    return await asyncio.get_running_loop().run_in_executor(_parsing, fn, *args, body)


def decode_body(tool: Tool, body: bytes, what: str = "the body") -> Any:
    """Decode a JSON object of params (`what` names it in error messages)."""
    check_json(body, what)
    if tool.params is Relayed:
        return relay_body(body, what)
    try:
        return msgspec.json.decode(body, type=tool.params)
    except msgspec.DecodeError as exc:  # a ValidationError too
        # msgspec stops at the first error, which may come before the JSON breaks: a body that
        # is not a JSON object is a 400 whatever it would have failed first.
        json_object(body, what)
        if not isinstance(exc, msgspec.ValidationError):
            raise ApiError(Code.BAD_REQUEST, f"{what} is not valid JSON: {exc}") from None
        raise _with_suggestion(tool, from_validation_error(exc)) from None


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """`body` as a JSON object, or 400: the one judge of that, for the tools here and those relayed."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError as bad:
        raise ApiError(Code.BAD_REQUEST, f"{what} is not valid JSON: {bad}") from None
    if not isinstance(decoded, dict):
        raise ApiError(Code.BAD_REQUEST, f"{what} must be a JSON object of params")
    return decoded


# Query keys the gateway reads itself (gateway/server/auth.py): never a tool's params.
GATEWAY_QUERY_KEYS = frozenset({"ticket"})


def decode_query(tool: Tool, query: QueryParams) -> Any:
    """Params from a query string: `params=<JSON>`, or one key per field."""
    if tool.params is Relayed:
        return _relayed_query([(k, v) for k, v in query.multi_items() if k not in GATEWAY_QUERY_KEYS])
    keys = [key for key in query.keys() if key not in GATEWAY_QUERY_KEYS]
    if "params" in query and "params" not in _fields(tool):
        # `model` may go beside params=<JSON>: the same JSON then runs on whichever model the URL names.
        if set(keys) - {"params", MODEL_FIELD} or len(query.getlist("params")) > 1:
            raise ApiError(
                Code.BAD_REQUEST, "give either params=<JSON> (and model=, if you like) or flat keys, not both"
            )
        params = decode_body(tool, query["params"].encode(), "the params= value")
        if (model := query.get(MODEL_FIELD)) is not None:
            if getattr(params, MODEL_FIELD, None) not in (None, model):
                raise ParamError(MODEL_FIELD, "given both in params= and as model=, differently")
            params = msgspec.structs.replace(params, **{MODEL_FIELD: model})
        return params
    lists = _list_fields(tool)
    obj: dict[str, Any] = {}
    for key in keys:
        values = query.getlist(key)
        if key in lists:
            obj[key] = values
        elif len(values) > 1:
            raise ParamError(key, "given more than once; it takes one value")
        else:
            obj[key] = values[0]
    try:
        return msgspec.convert(obj, tool.params, strict=False)
    except msgspec.ValidationError as exc:
        raise _with_suggestion(tool, from_validation_error(exc)) from None


def _with_suggestion(tool: Tool, error: ApiError) -> ApiError:
    """An unknown field close to a real one (a typo, a missing plural) says which it meant."""
    if error.field is None or "unknown field" not in error.message:
        return error
    parent, _, name = error.field.rpartition(".")
    close = difflib.get_close_matches(name, _names_at(tool.params, parent), n=1, cutoff=0.75)
    if close:
        error.message += f"; did you mean `{close[0]}`?"
    return error


def _names_at(tp: type, path: str) -> list[str]:
    """The field names of the Struct at `path` (`messages[0]`, `clamps[2]`) inside params Struct `tp`."""
    info: Any = _info(tp)
    for part in filter(None, re.sub(r"\[\d+\]", "", path).split(".")):
        field = next((f for f in info.fields if f.encode_name == part), None) if hasattr(info, "fields") else None
        if field is None:
            return []
        info = _struct_in(field.type)
    return [f.encode_name for f in info.fields] if hasattr(info, "fields") else []


def _struct_in(t: Any) -> Any:
    """The Struct a field holds, directly or as the items of a list; None if none."""
    for alternative in _alternatives(t):
        if isinstance(alternative, msgspec.inspect.StructType):
            return alternative
        if isinstance(alternative, _SEQUENCES):
            found = _struct_in(alternative.item_type)
            if found is not None:
                return found
    return None


# -- params of a tool that runs in another service -------------------------------------------


class Relayed(msgspec.Struct, frozen=True):
    """The params of a tool another service runs (an executor, an engine, a Ray replica), as the
    request gave them: that service decodes them with the tool's own Structs, so it refuses what a
    gateway running the tool would refuse, with the same answer. The gateway reads only the model
    they name, and passes the body's bytes on as they came: a request is decoded once, where it runs."""

    body: msgspec.Raw  # a POST's JSON object, as sent (`null`: the GET form's)
    query: list[tuple[str, str]] | None  # or the GET form's pairs, as sent (less GATEWAY_QUERY_KEYS)
    model: str | None  # the model they name, once resolved (None: none, or not a name, refused there)
    request: str = ""  # the rest, for `digest`: their JSON with its keys sorted, hashed (a body's: when asked)


class _Named(msgspec.Struct):
    """All a gateway reads of relayed params: the model they name (any other field skipped unread)."""

    model: Any = None


_named = msgspec.json.Decoder(_Named)


def relay_body(body: bytes, what: str = "the body") -> Relayed:
    """A JSON object of params relayed as it came (checked by `check_json`): only its `model` read."""
    try:
        model = _named.decode(body).model
    except msgspec.DecodeError:  # not JSON, or not an object: refused as a gateway running the tool would
        json_object(body, what)
        raise
    return Relayed(msgspec.Raw(body), None, model if isinstance(model, str) and model else None)


def _fields_digest(fields: dict[str, Any]) -> str:
    """What identifies relayed params, less the model they name when it is a name (or absent): keyed once
    resolved, the default named or not is one request."""
    model = fields.get(MODEL_FIELD)
    if (isinstance(model, str) and model) or model is None:
        fields = {k: v for k, v in fields.items() if k != MODEL_FIELD}
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()


_NULL = msgspec.Raw(b"null")


def _relayed(fields: dict[str, Any], body: msgspec.Raw = _NULL, query: list[tuple[str, str]] | None = None) -> Relayed:
    model = fields.get(MODEL_FIELD)
    return Relayed(body, query, model if isinstance(model, str) and model else None, _fields_digest(fields))


def _relayed_query(pairs: list[tuple[str, str]]) -> Relayed:
    """The GET form relayed: its pairs as they came; the model from `model=` or `params=<JSON>`."""
    given: dict[str, list[str]] = {}
    for key, value in pairs:
        given.setdefault(key, []).append(value)
    fields: dict[str, Any] = {k: v[0] if len(v) == 1 else v for k, v in given.items()}
    if isinstance(text := fields.pop("params", None), str):
        try:
            check_json(text.encode())
            inner = msgspec.json.decode(text)
        except (ApiError, msgspec.DecodeError):
            inner = None  # refused where the tool runs, as a gateway running it refuses it
        if not isinstance(inner, dict):
            fields["params"] = text
        else:
            within, beside = inner.get(MODEL_FIELD), fields.get(MODEL_FIELD)
            fields = {**inner, **fields}  # as a body with those params would be
            if None not in (within, beside) and within != beside:
                fields[MODEL_FIELD] = [within, beside]  # two models, refused there: not a name here
    return _relayed(fields, query=pairs)


def from_fields(tool: Tool, fields: dict[str, Any]) -> Any:
    """`tool`'s params from fields another surface built (the OpenAI routes); 422 naming a field that fails."""
    if tool.params is Relayed:
        return _relayed(fields, body=msgspec.Raw(msgspec.json.encode(fields)))
    try:
        return msgspec.convert(fields, tool.params)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None


async def decode_relayed(tool: Tool, body: bytes, query: list[tuple[str, str]] | None, model: str | None, what: str) -> Any:
    """Params a gateway relayed (the wire's `params`, `query` and `model`), decoded where the tool
    runs as that gateway would have decoded them: the GET form's pairs as its query, the body as
    its body (`what`), and on the model that gateway resolved when they name none."""
    if query is not None:
        params = decode_query(tool, QueryParams(query))
    else:
        params = await off_loop(functools.partial(decode_body, what=what), body, tool)
    if model is not None and getattr(params, MODEL_FIELD, None) is None:
        params = msgspec.structs.replace(params, **{MODEL_FIELD: model})
    return params


async def decoded(tool: Tool, params: Any, limits: Mapping[str, int]) -> Any:
    """`params` as `tool`'s Struct, held to the server's caps: relayed ones decoded as the service that
    runs the tool decodes them (where a gateway runs a job's work itself, or must cut it first)."""
    if isinstance(params, Relayed):
        params = await decode_relayed(tool, bytes(params.body), params.query, params.model, "the body")
    apply_caps(tool, params, limits)
    return params


def on_model(params: Any, resolve: Callable[[str | None], str | None]) -> Any:
    """`params` with its `model` resolved to a served model's name (`resolve` answers 404 for
    an unknown one), so that what the job records, routes by and is keyed on never depends
    on which model was the default."""
    given = getattr(params, MODEL_FIELD, None)
    if not hasattr(params, MODEL_FIELD) or (name := resolve(given)) == given:
        return params
    return msgspec.structs.replace(params, **{MODEL_FIELD: name})


def digest(tool_name: str, params: Any) -> str:
    """What identifies a request for its idempotency key: the tool and its decoded params.

    Decoded, so key order, spacing and defaults left out or written out do not
    make two requests differ; the GET form and the POST body of the same params agree.
    Params relayed to the service that runs the tool are compared as JSON (`Relayed`): key
    order, spacing and the model's name do not matter there; a default, or the flat GET form, does.
    """
    if isinstance(params, Relayed):
        request = params.request or _fields_digest(json_object(bytes(params.body), "the body"))
        data = f"{request}\0{params.model}".encode()
    else:
        data = msgspec.json.encode(params)
    return hashlib.sha256(tool_name.encode() + b"\0" + data).hexdigest()[:32]


async def digest_of(tool_name: str, params: Any) -> str:
    """`digest`, on the parsing thread where it must read a big relayed body (never on the event loop)."""
    if isinstance(params, Relayed) and not params.request and len(params.body) > INLINE_BYTES:
        return await off_loop(lambda body: digest(tool_name, params), bytes(params.body))
    return digest(tool_name, params)


def apply_caps(tool: Tool, params: Any, limits: Mapping[str, int]) -> None:
    """Enforce the server limits bound by `tool.caps`.

    The messages are msgspec's own for the same bound, as the schema that
    advertises it would have msgspec word them.
    """
    for name, limit_name in tool.caps.items():
        value = getattr(params, name, None)
        if value is None:
            continue
        limit = limits[limit_name]
        kind = _JSON_KIND.get(type(value), "int" if isinstance(value, int) else "float")
        if isinstance(value, (list, tuple, str, dict)):
            if len(value) > limit:
                raise ParamError(name, f"expected `{kind}` of length <= {limit}")
        elif value > limit:
            raise ParamError(name, f"expected `{kind}` <= {limit}")


_JSON_KIND = {list: "array", tuple: "array", str: "str", dict: "object"}


def schema(tp: Any, caps: Mapping[str, str] | None = None, limits: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A self-contained JSON Schema for `tp`: its own object at the top, `$defs` for the rest."""
    (ref,), components = msgspec.json.schema_components([tp], ref_template="#/$defs/{name}")
    if "$ref" in ref:
        top = copy.deepcopy(components.pop(ref["$ref"].rsplit("/", 1)[1]))
    else:
        top = dict(ref)
    if components:
        top["$defs"] = components
    for name, limit_name in (caps or {}).items():
        prop = top.get("properties", {}).get(name)
        if prop is None or limits is None:
            continue
        for variant in prop.get("anyOf", [prop]):
            kind = variant.get("type")
            key = {"array": "maxItems", "string": "maxLength", "object": "maxProperties"}.get(
                kind, "maximum"
            )
            if kind != "null":
                variant[key] = min(variant.get(key, limits[limit_name]), limits[limit_name])
    return top


def _fields(tool: Tool) -> frozenset[str]:
    return frozenset(f.encode_name for f in _info(tool.params).fields)


_SEQUENCES = (
    msgspec.inspect.ListType,
    msgspec.inspect.TupleType,
    msgspec.inspect.VarTupleType,
    msgspec.inspect.SetType,
    msgspec.inspect.FrozenSetType,
)


@functools.cache
def _info(tp: type) -> Any:
    return msgspec.inspect.type_info(tp)


def _alternatives(t: Any) -> list[Any]:
    """The types a field may take, with `Annotated` metadata and unions unwrapped."""
    while isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    if isinstance(t, msgspec.inspect.UnionType):
        return [a for member in t.types for a in _alternatives(member)]
    return [t]


def _list_fields(tool: Tool) -> set[str]:
    names = set()
    for f in _info(tool.params).fields:
        if any(isinstance(t, _SEQUENCES) for t in _alternatives(f.type)):
            names.add(f.encode_name)
    return names
