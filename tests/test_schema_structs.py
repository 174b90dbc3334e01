"""`backends.schema_structs`: Structs rebuilt from published JSON Schema validate like the originals.

For the built-in tools and for Structs made here to cover every feature, the
rebuilt type (1) publishes the same schema again and (2) decodes generated JSON
(values built from the schema, perturbed, and plain junk) to the same result or
the same error message, so a remote tool answers a bad request exactly as a
local one does. Schemas it cannot express degrade to `Any` instead of raising.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import math
import uuid
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import Meta

from backends.schema_structs import struct_from_schema
from gateway.params import schema
from gateway.tools import builtin_tools

# -- Structs covering what a params schema can say -----------------------------------


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Level(enum.IntEnum):
    """How loud."""

    LOW = 1
    HIGH = 2


class Point(msgspec.Struct, forbid_unknown_fields=True):
    """A point in the plane."""

    x: float
    y: Annotated[float, Meta(ge=-1000, le=1000)] = 0.0


class Circle(msgspec.Struct, tag="circle", tag_field="kind", forbid_unknown_fields=True):
    r: Annotated[float, Meta(gt=0)]


class Square(msgspec.Struct, tag="square", tag_field="kind"):
    side: Annotated[int, Meta(ge=1)] = 1


class Add(msgspec.Struct, tag=1, tag_field="op"):
    value: int


class Neg(msgspec.Struct, tag=2, tag_field="op"):
    pass


class Solo(msgspec.Struct, tag=True):
    """Tagged, but never in a tagged union: the tag is read off its leading property."""

    a: int = 0


class Node(msgspec.Struct):
    value: int
    children: list[Node] = []


T = TypeVar("T")


class Page(msgspec.Struct, Generic[T]):
    items: list[T]
    next: str | None = None


def _other_point() -> type:
    class Point(msgspec.Struct):  # same name as the module's Point: published by full name
        z: int = 0

    return Point


OtherPoint = _other_point()


class Kitchen(msgspec.Struct, forbid_unknown_fields=True):
    """Everything at once."""

    name: Annotated[str, Meta(min_length=1, max_length=12, pattern="^[a-z]+$", description="A name.")]
    points: Annotated[list[Point], Meta(min_length=1, max_length=4)]
    count: Annotated[int, Meta(gt=0, lt=100, multiple_of=3, title="Count", examples=[3, 6])] = 3
    ratio: Annotated[float, Meta(gt=0.0, lt=1.0)] | None = None
    step: Annotated[float, Meta(multiple_of=0.5, le=10)] = 1.0
    mode: Literal["fast", "slow"] = "fast"
    number: Literal[1, 2, 3] | None = None
    color: Annotated[Color, Meta(description="Which colour.")] = Color.RED
    level: Level | None = None
    origin: Point | None = None
    pair: tuple[int, Annotated[str, Meta(max_length=3)]] = (1, "a")
    weights: Annotated[dict[str, Annotated[float, Meta(ge=0)]], Meta(max_length=3)] = {}
    keyed: Annotated[dict[Annotated[str, Meta(min_length=2)], int], Meta(min_length=1)] | None = None
    tags: set[str] = set()
    flag: bool = False
    either: int | str | None = None
    ints_or_map: list[int] | dict[str, int] | None = None
    shape: Circle | Square | None = None
    tree: Node | None = None
    page: Page[int] | None = None
    anything: Any = None
    raw: list = []
    nested: list[list[Annotated[int, Meta(ge=0)]]] = []


class Program(msgspec.Struct):
    steps: Annotated[list[Add | Neg], Meta(max_length=8)]
    first: Add | None = None
    solo: Solo | None = None
    near: Point | None = None
    far: OtherPoint | None = None


class Renamed(msgspec.Struct, rename="camel", forbid_unknown_fields=True):
    max_tokens: int = 1
    stop_words: list[str] = []


class Odd(msgspec.Struct, rename={"klass": "class", "dash": "a-b", "dunder": "__x__", "empty": ""}):
    klass: int
    dash: str = ""
    dunder: bool = False
    empty: int | None = None


class Times(msgspec.Struct, forbid_unknown_fields=True):
    when: Annotated[datetime.datetime, Meta(tz=True)] | None = None
    day: datetime.date | None = None
    at: Annotated[datetime.time, Meta(tz=False)] | None = None
    span: datetime.timedelta | None = None
    uid: uuid.UUID | None = None
    price: decimal.Decimal | None = None
    blob: bytes | None = None


class Factory(msgspec.Struct):
    a: int = 0
    # A default_factory other than list/dict/set is not published: the rebuilt
    # field is left UNSET (omitted when re-encoded) for the executor to fill in.
    made: list[int] = msgspec.field(default_factory=lambda: [1, 2])


class Empty(msgspec.Struct, forbid_unknown_fields=True):
    pass


EXTRA = [Kitchen, Program, Renamed, Odd, Times, Factory, Empty, Node, Point]
CASES = [pytest.param(t.params, id=t.name) for t in builtin_tools()] + [
    pytest.param(tp, id=tp.__name__) for tp in EXTRA
]


# -- round trip of the schema ---------------------------------------------------------


@pytest.mark.parametrize("original", CASES)
def test_schema_round_trips(original: type) -> None:
    published = schema(original)
    rebuilt = struct_from_schema(published, "fallback")
    assert isinstance(rebuilt, type) and issubclass(rebuilt, msgspec.Struct)
    assert rebuilt.__name__ == published["title"]
    # Exact: including $defs names (Page[int], two Points under their full names),
    # tags, enum classes and their descriptions, Meta titles/examples, defaults.
    assert schema(rebuilt) == published
    # And through JSON, as a remote gateway receives it.
    assert schema(struct_from_schema(json.loads(json.dumps(published)), "x")) == published


def test_name_is_used_without_a_title() -> None:
    published = schema(Point)
    del published["title"]
    assert struct_from_schema(published, "PointParams").__name__ == "PointParams"


# -- same decoding, same errors ---------------------------------------------------------


def _defs(published: dict) -> dict:
    return published.get("$defs", {})


def _resolve(node: Any, published: dict) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        key = node["$ref"].rsplit("/", 1)[1]
        node = _defs(published).get(key, published)  # a dangling self-ref is the top
    return node


JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
JUNK = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _number(node: dict, integer: bool) -> st.SearchStrategy:
    edges = [node.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node]
    near = [e + d for e in edges for d in (-1, 0, 1)] + [0, -1, 1, 2**63, -(2**63) - 1]
    if node.get("multipleOf"):
        near += [node["multipleOf"] * k for k in (-2, 1, 3, 7)]
    base = st.integers(-200, 200) if integer else st.floats(-200, 200) | st.integers(-200, 200)
    return base | st.sampled_from(near) | st.sampled_from([1.5, -0.5, 1e300])


def _string(node: dict) -> st.SearchStrategy:
    fmt = node.get("format")
    samples = {
        "date-time": ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05", "2024-13-02T03:04:05Z"],
        "date": ["2024-01-02", "2024-02-30"],
        "partial-time": ["03:04:05", "03:04:05Z", "25:00:00"],
        "duration": ["P1DT2H", "PT1S", "P1Y"],
        "uuid": [str(uuid.UUID(int=7)), "not-a-uuid"],
        "decimal": ["1.25", "NaN", "x1"],
    }
    if fmt in samples:
        return st.sampled_from(samples[fmt])
    if node.get("contentEncoding") == "base64":
        return st.sampled_from(["", "YWJj", "YQ==", "***"])
    lo, hi = node.get("minLength", 0), node.get("maxLength", 14)
    texts = st.text(alphabet="abcxyzAZ 0_é", min_size=max(0, lo - 1), max_size=hi + 1)
    if "pattern" in node:
        texts = texts | st.from_regex(node["pattern"], fullmatch=True)
    return texts


def _value(node: Any, published: dict, depth: int) -> st.SearchStrategy:
    """Values near what `node` accepts (often valid, sometimes just over a bound), or junk."""
    node = _resolve(node, published)
    if depth > 3 or not isinstance(node, dict):
        return JUNK
    options = []
    for key in ("anyOf", "oneOf"):
        if key in node:
            options += [_value(m, published, depth + 1) for m in node[key]]
    if "enum" in node:
        options.append(st.sampled_from(node["enum"]))
    kind = node.get("type")
    if kind == "null":
        options.append(st.none())
    elif kind == "boolean":
        options.append(st.booleans())
    elif kind in ("integer", "number"):
        options.append(_number(node, kind == "integer"))
    elif kind == "string":
        options.append(_string(node))
    elif kind == "array" and "prefixItems" in node:
        items = [_value(i, published, depth + 1) for i in node["prefixItems"]]
        options.append(st.tuples(*items).map(list))
        options.append(st.lists(_value(node["prefixItems"][0], published, depth + 1), max_size=3))
    elif kind == "array":
        lo, hi = node.get("minItems", 0), node.get("maxItems", 4)
        item = _value(node.get("items", {}), published, depth + 1)
        options.append(st.lists(item, min_size=max(0, lo - 1), max_size=min(hi + 1, 5)))
    elif kind == "object" and "properties" in node:
        options.append(_object(node, published, depth))
    elif kind == "object":
        key = _string(node.get("propertyNames", {})) if "propertyNames" in node else st.text(max_size=4)
        value = _value(node.get("additionalProperties", {}), published, depth + 1)
        options.append(st.dictionaries(key, value, max_size=min(node.get("maxProperties", 3) + 1, 5)))
    if not options:
        return JUNK  # Any
    return st.one_of(*options, *options, JUNK)  # mostly shaped like the schema


def _object(node: dict, published: dict, depth: int) -> st.SearchStrategy:
    props = node["properties"]
    required = set(node.get("required", []))

    @st.composite
    def build(draw: Any) -> dict:
        out = {}
        for name, spec in props.items():
            present = draw(st.integers(0, 9)) > (0 if name in required else 5)
            if present:
                out[name] = draw(_value(spec, published, depth + 1))
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.sampled_from(["extra", "type", "kind", "x"]))] = draw(JSON_LEAF)
        return out

    return build()


def _valid(node: Any, published: dict, depth: int) -> st.SearchStrategy:
    """Values `node` accepts (optional fields sometimes left out)."""
    node = _resolve(node, published)
    if not isinstance(node, dict) or not ({"type", "enum", "anyOf", "oneOf"} & set(node)):
        return JUNK  # Any
    if "enum" in node:
        return st.sampled_from(node["enum"])
    members = node.get("anyOf") or node.get("oneOf")
    if members:
        if depth > 3 and {"type": "null"} in members:
            return st.none()
        return st.one_of(*[_valid(m, published, depth + 1) for m in members])
    kind = node["type"]
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        lo = node.get("minimum", node.get("exclusiveMinimum", -500))
        hi = node.get("maximum", node.get("exclusiveMaximum", 500))
        step = node.get("multipleOf")
        if kind == "integer" or step:
            unit = step or 1
            lo_k, hi_k = math.ceil(lo / unit), math.floor(hi / unit)
            values = st.integers(lo_k, hi_k).map(lambda k: k * unit)
        else:
            values = st.floats(lo, hi, allow_nan=False)
        return values.filter(
            lambda v: node.get("exclusiveMinimum", -math.inf) < v < node.get("exclusiveMaximum", math.inf)
        )
    if kind == "string":
        if "format" in node or "contentEncoding" in node:
            return _string(node)  # a mix of good and bad samples
        lo, hi = node.get("minLength", 0), node.get("maxLength", 10)
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True).filter(lambda t: lo <= len(t) <= hi)
        return st.text(alphabet="abcxyz _é", min_size=lo, max_size=hi)
    if kind == "array" and "prefixItems" in node:
        return st.tuples(*[_valid(i, published, depth + 1) for i in node["prefixItems"]]).map(list)
    if kind == "array":
        lo = node.get("minItems", 0)
        hi = lo if depth > 3 else min(node.get("maxItems", 3), lo + 3)
        item = _valid(node.get("items", {}), published, depth + 1)
        return st.lists(item, min_size=lo, max_size=hi, unique=bool(node.get("uniqueItems")))
    if kind == "object" and "properties" in node:
        required = set(node.get("required", []))
        fields = {
            name: _valid(spec, published, depth + 1) if depth <= 3 or name in required else st.nothing()
            for name, spec in node["properties"].items()
        }
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "object":
        names = node.get("propertyNames", {})
        key = st.text(alphabet="abk", min_size=names.get("minLength", 0), max_size=names.get("maxLength", 5))
        lo, hi = node.get("minProperties", 0), node.get("maxProperties", 3)
        value = _valid(node.get("additionalProperties", {}), published, depth + 1)
        return st.dictionaries(key, value, min_size=lo, max_size=hi)
    return JUNK


@st.composite
def _one_wrong(draw: Any, published: dict) -> Any:
    """A valid object with one field replaced by something near, or junk."""
    obj = draw(_valid(published, published, 0))
    props = published.get("properties", {})
    if props:
        name = draw(st.sampled_from(sorted(props)))
        obj[name] = draw(_value(props[name], published, 1))
    return obj


def _outcome(tp: type, data: bytes) -> tuple[str, Any]:
    try:
        value = msgspec.json.decode(data, type=tp)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", msgspec.to_builtins(value)


def _normalised(want: tuple[str, Any], got: tuple[str, Any], rebuilt: type) -> tuple[str, Any]:
    """`want` less the fields the rebuilt Struct left UNSET: their default is not published."""
    if want[0] == got[0] == "ok" and isinstance(want[1], dict):
        unset = {f.encode_name for f in msgspec.structs.fields(rebuilt) if f.default is msgspec.UNSET}
        return "ok", {k: v for k, v in want[1].items() if k in got[1] or k not in unset}
    return want


def _same(original: type, rebuilt: type, data: bytes) -> None:
    want, got = _outcome(original, data), _outcome(rebuilt, data)
    assert got == _normalised(want, got, rebuilt), data
    # The GET form: flat keys, strings coerced (`decode_query` uses `convert(strict=False)`).
    try:
        obj = json.loads(data)
    except ValueError:
        return
    if isinstance(obj, dict):
        flat = {k: (v if isinstance(v, list) else str(v)) for k, v in obj.items()}
        for source in (obj, flat):
            results = []
            for tp in (original, rebuilt):
                try:
                    results.append(("ok", msgspec.to_builtins(msgspec.convert(source, tp, strict=False))))
                except msgspec.ValidationError as exc:
                    results.append(("error", str(exc)))
            assert results[1] == _normalised(results[0], results[1], rebuilt), source


@pytest.mark.parametrize("original", CASES)
def test_decodes_like_the_original(original: type) -> None:
    published = schema(original)
    rebuilt = struct_from_schema(json.loads(json.dumps(published)), "x")
    inputs = (
        st.one_of(
            _valid(published, published, 0),
            _one_wrong(published),
            _value(published, published, 0),
            JUNK,
        ).map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=12)
        | st.sampled_from([b"", b"{", b"[]", b"null", b'{"a":', b"\xff", b"{}"])
    )

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(inputs)
    def check(data: bytes) -> None:
        _same(original, rebuilt, data)

    check()


def test_every_builtin_accepts_its_defaults_and_reports_fields_the_same() -> None:
    from gateway.errors import ApiError
    from gateway.params import decode_body
    from gateway.tools.base import Tool

    for tool in builtin_tools():
        remote = Tool(
            name=tool.name,
            description=tool.description,
            params=struct_from_schema(schema(tool.params), tool.name),
            result=Any,
            run=tool.run,
            caps=tool.caps,
        )
        for body in (b'{"nope": 1}', b"{}", b'{"prompt": 5}', b'{"prompts": []}', b"[1]", b"{"):
            outcomes = []
            for t in (tool, remote):
                try:  # `{}` is whole where every field has a default (generate checks its prompts or messages later)
                    outcomes.append(("decoded", msgspec.to_builtins(decode_body(t, body))))
                except ApiError as error:
                    outcomes.append((error.code, error.message, error.field))
            assert outcomes[0] == outcomes[1], (tool.name, body)
            assert body == b"{}" or outcomes[0][0] != "decoded", (tool.name, body)


# -- degradation -------------------------------------------------------------------------


def _field(cls: type, name: str) -> Any:
    return (
        msgspec.inspect.type_info(cls)
        .fields[[f.name for f in msgspec.inspect.type_info(cls).fields].index(name)]
        .type
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "string", "x-vendor": 1},  # unknown keyword
        {"type": "quaternion"},  # unknown type
        {"not": {"type": "string"}},
        {
            "anyOf": [
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "string"}},
            ]
        },
        {"anyOf": [{"type": "string"}, {"enum": ["a", "b"]}, {"type": "string", "format": "date"}]},
        {"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},  # two untagged Structs
        {"type": ["array", "null"], "prefixItems": [{"type": "integer"}], "minItems": 0, "maxItems": 1},
        {"enum": [1.5, 2.5]},
        {"enum": [True, "yes"]},
        {"type": "integer", "minimum": 1.5},
        {"type": "integer", "exclusiveMinimum": True, "minimum": 0},  # draft-4 style
        {"type": "string", "pattern": "\\p{L}+"},  # not a Python regex
        {"$ref": "#/$defs/Missing"},
        {"$ref": "https://example.com/schema.json"},
        {"type": "array", "items": {"type": "string"}, "contains": {"const": "x"}},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {}}},
        {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["a"]}},
        {"allOf": [{"type": "integer"}, {"minimum": 1}]},
        False,
        {"title": 5, "type": "string"},
    ],
)
def test_what_msgspec_cannot_express_becomes_any(spec: Any) -> None:
    published = {
        "title": "P",
        "type": "object",
        "properties": {"f": spec, "ok": {"type": "integer", "default": 0}},
        "required": ["f"],
        "$defs": {
            "A": {"title": "A", "type": "object", "properties": {"a": {"type": "integer"}}, "required": []},
            "B": {"title": "B", "type": "object", "properties": {"b": {"type": "integer"}}, "required": []},
            "Loop": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/Loop"}}]},
        },
    }
    cls = struct_from_schema(published, "P")
    assert isinstance(_field(cls, "f"), msgspec.inspect.AnyType)
    assert isinstance(_field(cls, "ok"), msgspec.inspect.IntType)  # the rest is still checked
    for value in (None, 1, "x", [1, [2]], {"k": "v"}):
        assert msgspec.json.decode(msgspec.json.encode({"f": value}), type=cls).f == value
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at `\$.ok`"):
        msgspec.json.decode(b'{"f": 1, "ok": "x"}', type=cls)


@pytest.mark.parametrize(
    "published",
    [
        {},
        {"type": "string"},
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"title": "T", "type": "object", "properties": 5},
        {"title": "T", "type": "object", "properties": {"a": {"type": "integer"}}, "required": "a"},
        {"$ref": "#/$defs/Nowhere"},
        [],
        None,
    ],
)
def test_a_top_that_is_no_object_still_gives_a_struct(published: Any) -> None:
    cls = struct_from_schema(published, "Top")
    assert issubclass(cls, msgspec.Struct)
    msgspec.json.decode(b'{"a": 1}', type=cls)


def test_a_top_keeps_its_fields_when_it_carries_keywords_it_cannot_apply() -> None:
    published = schema(Point) | {"minProperties": 1, "dependentRequired": {"x": ["y"]}}
    cls = struct_from_schema(published, "P")
    assert schema(cls) == schema(Point)  # permissive: the executor checks the rest
    with pytest.raises(msgspec.ValidationError, match="missing required field `x`"):
        msgspec.json.decode(b"{}", type=cls)


def test_hand_written_forms() -> None:
    published = {
        "type": "object",
        "properties": {
            "n": {"type": ["integer", "null"], "minimum": 0},
            "c": {"const": "only"},
            "o": {"allOf": [{"$ref": "#/definitions/Inner"}], "description": "wrapped"},
            "i": {
                "type": "object",
                "title": "Inline",
                "properties": {"q": {"type": "boolean"}},
                "required": ["q"],
            },
            "m": {"type": "string", "format": "email"},
            "u": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        },
        "required": ["n"],
        "definitions": {"Inner": {"type": "object", "properties": {"z": {"type": "integer"}}}},
    }
    cls = struct_from_schema(published, "Hand")
    assert cls.__name__ == "Hand"
    ok = msgspec.json.decode(
        b'{"n": null, "c": "only", "o": {"z": 1}, "i": {"q": true}, "m": "a@b", "u": [1, 1, 2]}', type=cls
    )
    assert msgspec.to_builtins(ok) == {
        "n": None,
        "c": "only",
        "o": {"z": 1},
        "i": {"q": True},
        "m": "a@b",
        "u": [1, 2],
    }
    for body, message in [
        (b'{"n": -1}', "Expected `int` >= 0 - at `$.n`"),
        (b'{"n": 1, "c": "other"}', "Invalid enum value 'other' - at `$.c`"),
        (b'{"n": 1, "o": {"z": "1"}}', "Expected `int`, got `str` - at `$.o.z`"),
        (b'{"n": 1, "i": {}}', "Object missing required field `q` - at `$.i`"),
    ]:
        with pytest.raises(msgspec.ValidationError) as info:
            msgspec.json.decode(body, type=cls)
        assert str(info.value) == message
    assert schema(cls)["properties"]["m"] == {"type": "string", "format": "email"}


# Arbitrary schema-shaped junk: the builder never raises, and what it builds never
# fails decoding with anything but a validation or decode error.
SCHEMA_KEYS = [
    "type",
    "properties",
    "required",
    "items",
    "prefixItems",
    "anyOf",
    "oneOf",
    "allOf",
    "enum",
    "const",
    "$ref",
    "additionalProperties",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "uniqueItems",
    "format",
    "title",
    "default",
    "multipleOf",
    "propertyNames",
    "minProperties",
    "discriminator",
    "x-odd",
]
SCHEMA_LEAVES = (
    st.sampled_from(
        [
            "object",
            "array",
            "string",
            "integer",
            "number",
            "boolean",
            "null",
            "#/$defs/A",
            "#",
            "date",
            "^a+$",
            "(",
        ]
    )
    | st.integers(-3, 5)
    | st.floats(-2, 2)
    | st.booleans()
    | st.none()
)
SCHEMAS = st.recursive(
    SCHEMA_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(SCHEMA_KEYS), inner, max_size=4)
        | st.dictionaries(st.sampled_from(["a", "b", "type", "kind"]), inner, max_size=3)
    ),
    max_leaves=14,
)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    top=SCHEMAS,
    defs=st.dictionaries(st.sampled_from(["A", "B"]), SCHEMAS, max_size=2),
    data=st.lists(JUNK, max_size=3),
)
def test_never_raises_on_odd_schemas(top: Any, defs: dict, data: list) -> None:
    published = {"type": "object", "properties": top, "$defs": defs} if isinstance(top, dict) else top
    cls = struct_from_schema(published, "Odd")
    assert issubclass(cls, msgspec.Struct)
    schema(cls)
    for value in data:
        try:
            msgspec.json.decode(json.dumps(value).encode(), type=cls)
        except msgspec.ValidationError:
            pass


def test_recursion_without_a_struct_is_cut_with_any() -> None:
    published = {
        "title": "P",
        "type": "object",
        "properties": {"f": {"$ref": "#/$defs/Loop"}},
        "required": ["f"],
        "$defs": {
            "Loop": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/Loop"}}]}
        },
    }
    cls = struct_from_schema(published, "P")
    assert msgspec.json.decode(b'{"f": [1, [2, ["x"]]]}', type=cls).f == [1, [2, ["x"]]]
    with pytest.raises(msgspec.ValidationError, match="Expected `int | array`, got `str`"):
        msgspec.json.decode(b'{"f": "x"}', type=cls)


def test_recursive_and_shared_definitions_are_one_class() -> None:
    cls = struct_from_schema(schema(Kitchen), "K")
    info = msgspec.inspect.type_info(cls)
    by_name = {f.name: f.type for f in info.fields}
    tree = by_name["tree"].types[0]
    assert tree.cls.__name__ == "Node"
    children = next(f for f in tree.fields if f.name == "children").type
    assert children.item_type.cls is tree.cls  # recursion closes on the same class
    assert by_name["origin"].types[0].cls is by_name["points"].item_type.cls  # shared: built once


def test_defaults_take_the_field_type() -> None:
    made = struct_from_schema(schema(Kitchen), "K")(name="a", points=[])
    assert isinstance(made.color, enum.Enum) and made.color.value == "red"
    assert made.pair == (1, "a") and made.tags == set() and made.weights == {} and made.step == 1.0
    assert made.ratio is None and made.mode == "fast"
    factory = struct_from_schema(schema(Factory), "F")()
    assert factory.made is msgspec.UNSET and msgspec.json.encode(factory) == b'{"a":0}'
