"""msgspec Struct types rebuilt from the JSON Schema that `GET /tools` publishes.

A gateway with a remote backend knows an executor's tools only from their JSON
Schema: it has no Python code for their params. It must still refuse a bad
request up front, and refuse it exactly as the local backend would (same 422,
same message, same `field`), so that the two backends cannot be told apart.
`struct_from_schema` therefore turns a tool's params schema back into a
`msgspec.Struct` type, and the remote tool goes through the very same
`gateway.params.decode_body` / `decode_query` / `apply_caps` as a local one.

It inverts what `gateway.params.schema()` (that is, msgspec's schema
generator) writes: objects with `properties` become Structs (cached per
`$defs` entry, so shared and recursive definitions work; `additionalProperties:
false` gives `forbid_unknown_fields`; a leading single-value `enum` property
required by the object is read as a Struct tag), `$defs` enums become `Enum`
classes, inline `enum`/`const` become `Literal`, `anyOf`/`oneOf` become unions,
`items`/`prefixItems`/`additionalProperties` become lists, sets, tuples and
dicts, and the constraints msgspec knows go into `msgspec.Meta`. Schemas made
by msgspec round-trip: `schema(struct_from_schema(schema(T)))` equals
`schema(T)`, and both types decode the same inputs with the same errors.

What msgspec cannot express (an unknown keyword or type, a union msgspec
rejects, a constraint it cannot apply, a dangling `$ref`, a recursive
definition that is not an object) becomes `typing.Any` for that node only. That
is deliberately permissive: the executor validates again, and `Any` passes the
value on untouched. `struct_from_schema` never raises.
"""

from __future__ import annotations

import copy
import datetime
import decimal
import enum
import functools
import keyword
import types
import typing
import uuid
from typing import Annotated, Any, Literal, Union
from urllib.parse import unquote

import msgspec

__all__ = ["struct_from_schema"]

# Keywords that only describe: carried into `Meta`, never validated.
_META_KEYS = {"title", "description"}
_EXTRA_KEYS = {"examples", "$comment", "deprecated", "readOnly", "writeOnly"}
# Meaningful at the top of a self-contained schema only.
_ROOT_KEYS = {"$defs", "definitions", "$schema", "$id"}

_NUMBER_KEYS = {
    "minimum": "ge",
    "exclusiveMinimum": "gt",
    "maximum": "le",
    "exclusiveMaximum": "lt",
    "multipleOf": "multiple_of",
}
_STRING_KEYS = {"minLength": "min_length", "maxLength": "max_length", "pattern": "pattern"}
_ARRAY_KEYS = {"minItems": "min_length", "maxItems": "max_length"}
_OBJECT_KEYS = {"minProperties": "min_length", "maxProperties": "max_length"}
_STRUCT_KEYS = {"type", "properties", "required", "additionalProperties"}

# The keywords each JSON type takes.
_TYPE_KEYS: dict[str, set[str]] = {
    "null": set(),
    "boolean": set(),
    "integer": set(_NUMBER_KEYS),
    "number": set(_NUMBER_KEYS),
    "string": set(_STRING_KEYS) | {"format", "contentEncoding"},
    "array": set(_ARRAY_KEYS) | {"items", "prefixItems", "uniqueItems"},
    "object": set(_OBJECT_KEYS) | _STRUCT_KEYS - {"type"} | {"propertyNames"},
}

# `format` values msgspec writes for its own string-encoded types.
_FORMATS: dict[str, Any] = {
    "date-time": Annotated[datetime.datetime, msgspec.Meta(tz=True)],
    "date": datetime.date,
    "time": Annotated[datetime.time, msgspec.Meta(tz=True)],
    "partial-time": Annotated[datetime.time, msgspec.Meta(tz=False)],
    "duration": datetime.timedelta,
    "uuid": uuid.UUID,
    "decimal": decimal.Decimal,
}

# Scalar item types a `uniqueItems` array may decode into a set of.
_HASHABLE = (
    str,
    int,
    float,
    bool,
    type(None),
    bytes,
    datetime.date,
    datetime.time,
    datetime.datetime,
    datetime.timedelta,
    uuid.UUID,
    decimal.Decimal,
)

# The class attribute through which rebuilt Structs reach each other (see `_Builder._ref`).
_NS = "_schema_structs_refs_"


def struct_from_schema(schema: dict, name: str) -> type[msgspec.Struct]:
    """A Struct type that decodes what `schema` describes, as the Struct it was made from did.

    `schema` is self-contained, as `gateway.params.schema()` writes it: the object
    at the top, definitions under `$defs`, referenced as `#/$defs/Name`. The Struct
    (and every nested one) is named after its schema's `title`; `name` is used
    when the top has none. A top that describes no object gives a Struct without
    fields, which accepts any JSON object.
    """
    try:
        cls = _Builder(schema).top(name)
        msgspec.json.Decoder(cls)  # resolves every type now: nothing may fail later
        return cls
    except Exception:
        pass
    try:
        # Something slipped through: keep the top's fields, required and defaults, untyped.
        cls = _Builder(schema, untyped=True).top(name)
        msgspec.json.Decoder(cls)
        return cls
    except Exception:
        pass
    try:
        return msgspec.defstruct(name, [])
    except Exception:
        return msgspec.defstruct("Params", [])


_ANY: tuple[Any, Any] = (Any, Any)


def _json_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _literal_value(value: Any) -> bool:
    return value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _is_any(tp: Any) -> bool:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp is Any


def _with_meta(real: Any, probe: Any, meta_kw: dict[str, Any]) -> tuple[Any, Any]:
    """`Annotated[tp, Meta(...)]`, or Any when msgspec does not take that Meta on that type."""
    if not meta_kw:
        return real, probe
    try:
        meta = msgspec.Meta(**meta_kw)
        probe = Annotated[probe, meta]
        msgspec.inspect.type_info(probe)
    except Exception:
        return _ANY
    return Annotated[real, meta], probe


class _Builder:
    """One schema's worth of rebuilt types.

    Every node yields a pair (real, probe): the type to use, and a stand-in where
    each Struct is replaced by a field-less Struct with the same tag, so msgspec can
    vet unions and constraints (`inspect.type_info`) before recursive references
    are resolvable.
    """

    def __init__(self, root: Any, untyped: bool = False) -> None:
        self.root = root if isinstance(root, dict) else {}
        defs = self.root.get("$defs", self.root.get("definitions", {}))
        self.defs = defs if isinstance(defs, dict) else {}
        self.untyped = untyped
        self.ns = types.SimpleNamespace()  # attribute per Struct, for forward references
        self.done: dict[str, tuple[Any, Any]] = {}
        self.building: dict[str, tuple[str, Any]] = {}  # ref -> (attribute, probe)
        self.unresolved: set[str] = set()
        self.expanding: set[str] = set()  # non-Struct definitions being expanded
        self.count = 0
        self.tag_fields = self._discriminators(self.root)

    # -- the top and the references ---------------------------------------------

    def top(self, name: str) -> type[msgspec.Struct]:
        node = self.root
        if "$ref" in node and "properties" not in node:
            real, _ = self._ref(node["$ref"])
            if isinstance(real, type) and issubclass(real, msgspec.Struct):
                return real
            node = {}
        title = node.get("title")
        cls_name = title if isinstance(title, str) and title else name
        if not isinstance(cls_name, str) or not cls_name:
            cls_name = "Params"
        if not self._struct_like(node):
            return msgspec.defstruct(cls_name, [])
        real, _ = self._struct_ref("#", node, cls_name, None, top=True)
        return real

    def _ref(self, ref: Any) -> tuple[Any, Any]:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return _ANY  # only references inside this schema
        ref = self._canonical(ref)
        if ref in self.done:
            return self.done[ref]
        if ref in self.building:
            # A Struct refers (maybe through others) to one being built: name it
            # through the namespace object all rebuilt Structs carry; msgspec
            # resolves the name on first use, once every class exists.
            attr, probe = self.building[ref]
            self.unresolved.add(ref)
            return typing.ForwardRef(f"{_NS}.{attr}", is_argument=False, is_class=True), probe
        target = self._target(ref)
        if target is None:
            return _ANY
        if self._struct_like(target):
            key = ref.rsplit("/", 1)[-1]
            title = target.get("title")
            cls_name = title if isinstance(title, str) and title else key
            module = key[: -len(cls_name) - 1] if key.endswith("." + cls_name) else None
            result = self._struct_ref(ref, target, cls_name, module)
        elif (enum_type := self._enum_class(ref, target)) is not None:
            result = enum_type
        elif ref in self.expanding:
            return _ANY  # recursion without a class to anchor it
        else:
            self.expanding.add(ref)
            try:
                result = self._node(target)
            finally:
                self.expanding.discard(ref)
        self.done[ref] = result
        return result

    def _canonical(self, ref: str) -> str:
        # `params.schema()` lifts the top Struct out of `$defs`; a recursive one
        # still points at `#/$defs/<its title>`, which means the top.
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                key = self._key(ref[len(prefix) :])
                if key not in self.defs and key == self.root.get("title"):
                    return "#"
        return ref

    @staticmethod
    def _key(text: str) -> str:
        return unquote(text).replace("~1", "/").replace("~0", "~")

    def _target(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                target = self.defs.get(self._key(ref[len(prefix) :]))
                return target if isinstance(target, (dict, bool)) else None
        return None

    def _discriminators(self, node: Any) -> dict[str, str]:
        """ref -> tag field, for every Struct named in a tagged union's `discriminator`."""
        found: dict[str, str] = {}
        stack = [node]
        while stack:
            item = stack.pop()
            if isinstance(item, list):
                stack.extend(item)
            elif isinstance(item, dict):
                disc = item.get("discriminator")
                if isinstance(disc, dict) and isinstance(disc.get("propertyName"), str):
                    for ref in (disc.get("mapping") or {}).values():
                        if isinstance(ref, str):
                            found[self._canonical(ref)] = disc["propertyName"]
                stack.extend(item.values())
        return found

    # -- Structs and Enums -----------------------------------------------------------

    @staticmethod
    def _struct_like(node: Any) -> bool:
        if not isinstance(node, dict) or node.get("type", "object") != "object":
            return False
        return "properties" in node or "required" in node or node.get("additionalProperties") is False

    def _tag(self, ref: str, node: dict) -> tuple[str | None, Any]:
        props, required = node.get("properties"), node.get("required")
        if not isinstance(props, dict) or not props or not isinstance(required, list):
            return None, None
        first = next(iter(props))
        field = self.tag_fields.get(ref, first)
        spec = props.get(field)
        if field != first or field not in required or not isinstance(spec, dict) or set(spec) != {"enum"}:
            return None, None
        values = spec["enum"]
        if (
            isinstance(values, list)
            and len(values) == 1
            and _literal_value(values[0])
            and values[0] is not None
        ):
            return field, values[0]
        return None, None

    def _struct_ref(
        self, ref: str, node: dict, cls_name: str, module: str | None, top: bool = False
    ) -> tuple[Any, Any]:
        allowed = _STRUCT_KEYS | _META_KEYS | _EXTRA_KEYS | (_ROOT_KEYS | {"default"} if top else set())
        if not top and (set(node) - allowed or node.get("type", "object") != "object"):
            return _ANY
        props = node.get("properties", {})
        required = node.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list):
            if not top:
                return _ANY
            props, required = ({} if not isinstance(props, dict) else props), []
        tag_field, tag = self._tag(ref, node)
        probe = msgspec.defstruct(
            "Probe", [], tag_field=tag_field, tag=tag if tag_field else None, module=__name__
        )
        self.count += 1
        attr = f"d{self.count}"
        self.building[ref] = (attr, probe)
        try:
            fields: list[Any] = []
            rename: dict[str, str] = {}
            names = [p for p in props if p != tag_field]
            names += [r for r in required if isinstance(r, str) and r not in props and r != tag_field]
            for i, prop in enumerate(names):
                spec = props.get(prop, True)
                attr_name = prop
                if not prop.isidentifier() or keyword.iskeyword(prop) or prop.startswith("__") or prop == _NS:
                    attr_name = f"field_{i}"
                    while attr_name in props:
                        attr_name += "_"
                    rename[attr_name] = prop
                default = (
                    spec.get("default", msgspec.NODEFAULT) if isinstance(spec, dict) else msgspec.NODEFAULT
                )
                if isinstance(spec, dict) and "default" in spec:
                    spec = {k: v for k, v in spec.items() if k != "default"}
                real = Any if self.untyped else self._node(spec)[0]
                if prop in required:
                    fields.append((attr_name, real))
                elif default is msgspec.NODEFAULT:
                    # Not required, no default published (the original had a
                    # `default_factory`): leave it out, and the executor fills it in.
                    fields.append((attr_name, real, msgspec.UNSET))
                else:
                    fields.append((attr_name, real, self._default(real, default)))
            description = node.get("description")
            cls = msgspec.defstruct(
                cls_name,
                fields,
                kw_only=True,  # keep the published field order, required or not
                forbid_unknown_fields=node.get("additionalProperties") is False,
                tag_field=tag_field,
                tag=tag if tag_field else None,
                rename=rename or None,
                module=module,
                namespace={"__doc__": description if isinstance(description, str) else None, _NS: self.ns},
            )
        finally:
            del self.building[ref]
        setattr(self.ns, attr, cls)
        self.unresolved.discard(ref)
        self.done[ref] = (cls, probe)
        return cls, probe

    def _default(self, real: Any, raw: Any) -> Any:
        value = raw
        if not self.unresolved:  # msgspec cannot look into a type with pending references
            try:
                value = msgspec.convert(raw, real)  # e.g. a tuple, an Enum member
            except Exception:
                value = raw
        if isinstance(value, msgspec.Struct) or (isinstance(value, (list, dict, set, bytearray)) and value):
            return msgspec.field(default_factory=functools.partial(copy.deepcopy, value))
        return value

    def _enum_class(self, ref: str, node: Any) -> tuple[Any, Any] | None:
        """A titled `$defs` enum is an `Enum` class (as msgspec publishes one); None if not that."""
        if not isinstance(node, dict) or set(node) - {"title", "description", "enum"}:
            return None
        title, values = node.get("title"), node.get("enum")
        if not isinstance(title, str) or not title or not isinstance(values, list) or not values:
            return None
        if not (
            all(isinstance(v, str) for v in values)
            or all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        ):
            return None
        members, seen = [], set()
        for i, v in enumerate(values):
            member = v if isinstance(v, str) and v.isidentifier() and not v.startswith("_") else f"V{i}"
            if member in seen or member == "mro":
                member = f"V{i}"
            seen.add(member)
            members.append((member, v))
        key = ref.rsplit("/", 1)[-1]
        module = key[: -len(title) - 1] if key.endswith("." + title) else __name__
        try:
            cls = enum.Enum(title, members, module=module)
            description = node.get("description")
            cls.__doc__ = description if isinstance(description, str) else None
            msgspec.inspect.type_info(cls)
        except Exception:
            return None
        return cls, cls

    # -- any other node --------------------------------------------------------------

    def _node(self, node: Any) -> tuple[Any, Any]:
        if not isinstance(node, dict):
            return _ANY  # `true` allows anything; `false` (nothing) is not expressible
        meta: dict[str, Any] = {k: node[k] for k in _META_KEYS if isinstance(node.get(k), str)}
        extra = {k: node[k] for k in _EXTRA_KEYS if k in node}
        if extra:
            meta["extra_json_schema"] = extra
        rest = {k: v for k, v in node.items() if k not in _META_KEYS and k not in _EXTRA_KEYS}
        if any(k in _META_KEYS and not isinstance(node[k], str) for k in node):
            return _ANY
        rest.pop("default", None)  # below a property, a default annotates nothing msgspec keeps
        if not rest:
            return (Annotated[Any, msgspec.Meta(**meta)],) * 2 if meta else _ANY

        if "$ref" in rest:
            if len(rest) > 1:
                return _ANY
            real, probe = self._ref(rest["$ref"])
            return _with_meta(real, probe, meta) if real is not Any else _ANY
        if "allOf" in rest:
            parts = rest["allOf"]
            if len(rest) > 1 or not isinstance(parts, list) or len(parts) != 1:
                return _ANY
            real, probe = self._node(parts[0])
            return _with_meta(real, probe, meta) if real is not Any else _ANY
        if "anyOf" in rest or "oneOf" in rest:
            # `discriminator` is msgspec's note on a tagged union; the tags are read off the Structs.
            key = "anyOf" if "anyOf" in rest else "oneOf"
            if set(rest) - {key, "discriminator"}:
                return _ANY
            return self._union(rest[key], meta)
        if "enum" in rest or "const" in rest:
            return self._literal(rest, meta)

        kind = rest.get("type")
        if isinstance(kind, list):
            # `"type": ["integer", "null"]`: each type takes the keywords that apply to it.
            if not kind or not all(isinstance(k, str) and k in _TYPE_KEYS for k in kind):
                return _ANY
            if set(rest) - {"type"} - set().union(*(_TYPE_KEYS[k] for k in kind)):
                return _ANY
            members = [
                {k: v for k, v in rest.items() if k in _TYPE_KEYS[t]} | {"type": t}
                for t in dict.fromkeys(kind)
            ]
            return self._union(members, meta)
        if kind == "null":
            return self._simple(rest, set(), type(None), {}, meta)
        if kind == "boolean":
            return self._simple(rest, set(), bool, {}, meta)
        if kind in ("integer", "number"):
            return self._number(rest, kind, meta)
        if kind == "string":
            return self._string(rest, meta)
        if kind == "array":
            return self._array(rest, meta)
        if kind == "object":
            if self._struct_like(rest):
                title = node.get("title")
                real, probe = self._struct_ref(
                    f"#inline-{id(node)}", node, title if isinstance(title, str) and title else "Object", None
                )
                return real, probe
            return self._dict(rest, meta)
        return _ANY

    def _simple(self, rest: dict, allowed: set, tp: Any, constraints: dict, meta: dict) -> tuple[Any, Any]:
        if set(rest) - allowed - {"type"}:
            return _ANY
        return _with_meta(tp, tp, {**constraints, **meta})

    def _number(self, rest: dict, kind: str, meta: dict) -> tuple[Any, Any]:
        constraints = {}
        for key, arg in _NUMBER_KEYS.items():
            if key in rest:
                value = rest[key]
                if not _json_number(value):
                    return _ANY  # e.g. draft-4 boolean exclusiveMinimum
                if kind == "integer" and isinstance(value, float) and value.is_integer():
                    value = int(value)
                constraints[arg] = value
        tp = int if kind == "integer" else float
        return self._simple(rest, set(_NUMBER_KEYS), tp, constraints, meta)

    def _string(self, rest: dict, meta: dict) -> tuple[Any, Any]:
        lengths = {arg: rest[k] for k, arg in _STRING_KEYS.items() if k in rest}
        fmt = rest.get("format")
        if rest.get("contentEncoding") == "base64":
            if set(rest) - {"type", "contentEncoding", "minLength", "maxLength"}:
                return _ANY
            # msgspec publishes 4*ceil(n/3) characters for n bytes: take the loosest n.
            constraints = {}
            low, high = rest.get("minLength"), rest.get("maxLength")
            if isinstance(low, int) and low > 0:
                constraints["min_length"] = 3 * (-(-low // 4) - 1) + 1
            if isinstance(high, int):
                constraints["max_length"] = 3 * (high // 4)
            return _with_meta(bytes, bytes, {**constraints, **meta})
        if isinstance(fmt, str) and fmt in _FORMATS and not lengths and set(rest) <= {"type", "format"}:
            tp = _FORMATS[fmt]
            return _with_meta(tp, tp, meta)
        if fmt is not None:
            # Other formats only annotate (JSON Schema does not assert them): keep it as a note.
            meta = {**meta, "extra_json_schema": {**meta.get("extra_json_schema", {}), "format": fmt}}
        return self._simple(
            {k: v for k, v in rest.items() if k != "format"}, set(_STRING_KEYS), str, lengths, meta
        )

    def _array(self, rest: dict, meta: dict) -> tuple[Any, Any]:
        if set(rest) - {"type", "items", "prefixItems", "uniqueItems"} - set(_ARRAY_KEYS):
            return _ANY
        if "prefixItems" in rest:
            prefix = rest["prefixItems"]
            if (
                not isinstance(prefix, list)
                or rest.get("uniqueItems")
                or rest.get("minItems") != len(prefix)
                or rest.get("maxItems") != len(prefix)
            ):
                return _ANY
            pairs = [self._node(p) for p in prefix]
            real = tuple[tuple(p[0] for p in pairs)] if pairs else tuple[()]
            probe = tuple[tuple(p[1] for p in pairs)] if pairs else tuple[()]
            return _with_meta(real, probe, meta)
        items = rest.get("items", True)
        if items is False:
            return _ANY
        item_real, item_probe = self._node(items)
        container = list
        if rest.get("uniqueItems") is True:
            base = item_real
            while typing.get_origin(base) is Annotated:
                base = typing.get_args(base)[0]
            if isinstance(base, type) and issubclass(base, _HASHABLE + (enum.Enum,)):
                container = set
        elif rest.get("uniqueItems") not in (None, False):
            return _ANY
        lengths = {arg: rest[k] for k, arg in _ARRAY_KEYS.items() if k in rest}
        if item_real is Any:
            real = probe = container
        else:
            real, probe = container[item_real], container[item_probe]
        return _with_meta(real, probe, {**lengths, **meta})

    def _dict(self, rest: dict, meta: dict) -> tuple[Any, Any]:
        if set(rest) - {"type", "additionalProperties", "propertyNames"} - set(_OBJECT_KEYS):
            return _ANY
        key_tp: Any = str
        names = rest.get("propertyNames")
        if names is not None:
            if not isinstance(names, dict) or set(names) - set(_STRING_KEYS) - _META_KEYS - _EXTRA_KEYS - {
                "type"
            }:
                return _ANY
            if names.get("type", "string") != "string":
                return _ANY
            key_tp, _ = self._node({**names, "type": "string"})
            if key_tp is Any:
                return _ANY
        value_real, value_probe = self._node(rest.get("additionalProperties", True))
        lengths = {arg: rest[k] for k, arg in _OBJECT_KEYS.items() if k in rest}
        return _with_meta(dict[key_tp, value_real], dict[key_tp, value_probe], {**lengths, **meta})

    def _union(self, members: Any, meta: dict) -> tuple[Any, Any]:
        if not isinstance(members, list) or not members:
            return _ANY
        pairs = [self._node(m) for m in members]
        if any(_is_any(real) for real, _ in pairs):
            return _ANY
        real = Union[tuple(p[0] for p in pairs)]  # noqa: UP007 (members may be ForwardRefs)
        probe = Union[tuple(p[1] for p in pairs)]  # noqa: UP007
        try:
            msgspec.inspect.type_info(probe)  # msgspec's union rules: one array type, one str type, ...
        except Exception:
            return _ANY
        return _with_meta(real, probe, meta)

    def _literal(self, rest: dict, meta: dict) -> tuple[Any, Any]:
        if set(rest) - {"enum", "const", "type"} or ("enum" in rest and "const" in rest):
            return _ANY
        values = rest["enum"] if "enum" in rest else [rest["const"]]
        if not isinstance(values, list) or not values or not all(_literal_value(v) for v in values):
            return _ANY
        tp = Literal[tuple(dict.fromkeys(values))]
        return _with_meta(tp, tp, meta) if self._checks(tp) else _ANY

    @staticmethod
    def _checks(tp: Any) -> bool:
        try:
            msgspec.inspect.type_info(tp)
            return True
        except Exception:
            return False
