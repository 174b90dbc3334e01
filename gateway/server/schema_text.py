"""JSON Schema as text for people: a field's type with its limits, its default and meaning.

msgspec writes a Struct's schema with `$ref`s into `$defs`, an Optional field
as `anyOf` with null, and a field's description on its non-null alternative.
`Fields` reads that back as `integer (1 ≤ x ≤ 512)` or `list (at most 16
items) of string`, for `streamgate tools TOOL` and for the `GET /docs` page.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any


class Fields:
    """The properties of an object in a JSON Schema (msgspec's: `$ref` to `$defs`), as text.

    Each field reads like a signature, `name = default` or `name (required)`,
    then its type with its limits, then its description. An object nested in
    a field (a list of messages, a map of settings) is listed under it, once
    per definition.
    """

    def __init__(self, root: dict[str, Any], width: int) -> None:
        self.defs: dict[str, Any] = root.get("$defs", {})
        self.width = width
        self.expanded: set[str] = set()

    def resolve(self, node: Any) -> dict[str, Any]:
        """`node` with its `$ref`s followed; the referring node's own keys (description, default) win."""
        node = node if isinstance(node, dict) else {}
        seen: set[str] = set()
        while isinstance(node.get("$ref"), str):
            name = node["$ref"].rsplit("/", 1)[-1]
            if name in seen or name not in self.defs:
                break
            seen.add(name)
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = {**self.defs[name], "title": self.defs[name].get("title", name), **rest}
        return node

    def of(self, node: Any, indent: int) -> list[str]:
        """The properties of the object at `node` as indented lines, nested objects under their fields."""
        node = self.resolve(node)
        required = set(node.get("required", ()))
        pad, more = " " * indent, " " * (indent + 4)
        lines: list[str] = []
        for name, prop in (node.get("properties") or {}).items():
            prop = self.resolve(prop)
            if name in required:
                head = f"{name} (required)"
            elif "default" in prop:
                head = f"{name} = {json.dumps(prop['default'], ensure_ascii=False)}"
            else:
                head = name
            lines += [pad + head, more + self.type_of(prop)]
            description = self.description(prop)
            if description:
                lines += textwrap.wrap(
                    description, max(40, self.width - len(more)), initial_indent=more, subsequent_indent=more
                )
            for nested in self.objects_in(prop):
                title = nested.get("title", "object")
                lines.append(f"{more}{title}:")
                lines += self.of(nested, indent + 6)
        return lines

    def description(self, node: dict[str, Any]) -> str:
        # msgspec puts an Optional field's description on its non-null alternative.
        if node.get("description"):
            return node["description"]
        for option in node.get("anyOf") or node.get("oneOf") or ():
            found = self.description(self.resolve(option))
            if found:
                return found
        return ""

    def type_of(self, node: Any) -> str:
        """`node`'s type in words, with its limits: `list (1 to 32 items) of string`, `integer (1 ≤ x ≤ 512)`."""
        node = self.resolve(node)
        options = node.get("anyOf") or node.get("oneOf")
        if options:
            resolved = [self.resolve(option) for option in options]
            named = " or ".join(self.type_of(option) for option in resolved if option.get("type") != "null")
            return named + (", or null" if any(option.get("type") == "null" for option in resolved) else "")
        if "const" in node:
            return json.dumps(node["const"], ensure_ascii=False)
        if "enum" in node:
            return "one of " + ", ".join(json.dumps(value, ensure_ascii=False) for value in node["enum"])
        kind = node.get("type")
        if isinstance(kind, list):
            return " or ".join(self.type_of({**node, "type": one}) for one in kind)
        if kind in ("integer", "number"):
            return kind + _limits(_bounds(node))
        if kind == "string":
            limits = [_count(node, "minLength", "maxLength", "character")]
            limits += [f"format {node['format']}"] if "format" in node else []
            limits += [f"matching {node['pattern']}"] if "pattern" in node else []
            return "string" + _limits(limits)
        if kind == "array":
            limits = _limits([_count(node, "minItems", "maxItems", "item")] + (["unique"] if node.get("uniqueItems") else []))
            if "prefixItems" in node:
                return f"list{limits} of ({', '.join(self.type_of(item) for item in node['prefixItems'])})"
            items = self.resolve(node.get("items"))
            return f"list{limits} of {self.type_of(items) if items else 'anything'}"
        if kind == "object":
            if node.get("properties"):
                return node.get("title", "object")
            values = node.get("additionalProperties")
            if isinstance(values, dict) and values:
                return f"map of string to {self.type_of(values)}"
            return "object"
        return kind if isinstance(kind, str) else "anything"

    def objects_in(self, node: Any) -> list[dict[str, Any]]:
        """The objects with properties inside `node` not listed yet: behind lists, maps and unions."""
        node = self.resolve(node)
        if node.get("type") == "object" and node.get("properties"):
            key = node.get("title") or json.dumps(node, sort_keys=True)
            if key in self.expanded:
                return []
            self.expanded.add(key)
            return [node]
        inner = [*(node.get("anyOf") or node.get("oneOf") or ()), *node.get("prefixItems", ())]
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                inner.append(node[key])
        return [found for option in inner for found in self.objects_in(option)]


def _bounds(node: dict[str, Any]) -> list[str]:
    low = ("≤", node["minimum"]) if "minimum" in node else ("<", node["exclusiveMinimum"]) if "exclusiveMinimum" in node else None
    high = ("≤", node["maximum"]) if "maximum" in node else ("<", node["exclusiveMaximum"]) if "exclusiveMaximum" in node else None
    bounds = []
    if low and high:
        bounds.append(f"{low[1]} {low[0]} x {high[0]} {high[1]}")
    elif low:
        bounds.append(f"x {'≥' if low[0] == '≤' else '>'} {low[1]}")
    elif high:
        bounds.append(f"x {high[0]} {high[1]}")
    if "multipleOf" in node:
        bounds.append(f"a multiple of {node['multipleOf']}")
    return bounds


def _count(node: dict[str, Any], low_key: str, high_key: str, unit: str) -> str:
    low, high = node.get(low_key), node.get(high_key)

    def units(n: int) -> str:
        return f"{n} {unit}" + ("" if n == 1 else "s")

    if low is not None and high is not None:
        return units(low) if low == high else f"{low} to {units(high)}"
    if low:
        return f"at least {units(low)}"
    if high is not None:
        return f"at most {units(high)}"
    return ""


def _limits(parts: list[str]) -> str:
    parts = [part for part in parts if part]
    return f" ({', '.join(parts)})" if parts else ""
