"""`GET /docs`: the OpenAPI document as one page a person can read.

Built from the same document `GET /openapi.json` serves, so it describes
exactly the tools the served model can run, with the server's limits applied.
Deliberately a page of plain HTML and inline CSS rendered on the server: no
script, no fonts or styles from elsewhere (a gateway on a closed network has
no CDN to load an API explorer from), and readable in a terminal browser.
Each tool shows its params (type, limits, default, description), its result,
what it streams, and a `curl` command to start from.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from gateway.server.schema_text import Fields

STYLE = """
:root { color-scheme: light dark; --line: #8884; --muted: #777; }
body { font: 15px/1.5 system-ui, sans-serif; max-width: 62rem; margin: 0 auto; padding: 1rem 1.25rem 4rem; }
h1 { margin-bottom: .25rem; } h2 { margin-top: 2.5rem; border-bottom: 1px solid var(--line); }
h3 { margin: 1.25rem 0 .5rem; font-size: 1rem; }
code, pre { font: 13px/1.45 ui-monospace, monospace; }
pre { padding: .75rem; overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; width: 100%; margin: .25rem 0 .75rem; }
th, td { text-align: left; vertical-align: top; padding: .35rem .5rem; border-bottom: 1px solid var(--line); }
th { font-weight: 600; } td.name { white-space: nowrap; }
.muted, caption { color: var(--muted); } caption { text-align: left; padding: .25rem 0; }
.method { font-weight: 700; } .required { color: #c0392b; font-size: .85em; }
nav ul { columns: 14rem; padding-left: 1.1rem; }
"""


def page(doc: Mapping[str, Any], base_url: str = "http://localhost:8000") -> str:
    """The whole page for an OpenAPI document from `gateway.server.openapi.document`; its commands call `base_url`."""
    schemas = doc.get("components", {}).get("schemas", {})
    fields = Fields({"$defs": schemas}, width=10_000)
    tools = {path: item for path, item in doc["paths"].items() if "tools" in item.get("post", {}).get("tags", ())}
    others = {path: item for path, item in doc["paths"].items() if path not in tools}
    info = doc["info"]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        '<meta name=viewport content="width=device-width, initial-scale=1">',
        f"<title>{_e(info['title'])} API</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(info['title'])} API <small class=muted>{_e(info['version'])}</small></h1>",
        f"<p>{_inline(info.get('description', ''))}</p>",
        "<p>Every tool runs as <code>POST /{tool}/run</code> with its params as a JSON body (or <code>GET</code> with them "
        "as query keys, for <code>EventSource</code>), and answers with the job's Server-Sent Events: <code>status</code>, "
        "<code>log</code>, <code>partial</code> output, then exactly one <code>data</code> (the result) or <code>error</code>. "
        'The same as JSON: <a href="/openapi.json">/openapi.json</a>. Try tools in the <a href="/">dashboard</a>.</p>',
        "<nav><h3>Tools</h3><ul>",
        *(f'<li><a href="#{_anchor(path)}">{_e(_tool_name(path))}</a></li>' for path in tools),
        "</ul>",
        *_refused(info.get("x-unsupported-tools", {})),
        "<h3>Other routes</h3><ul>",
        *(f'<li><a href="#{_anchor(path)}">{_e(path)}</a></li>' for path in others),
        '<li><a href="#errors">Errors</a></li></ul></nav>',
    ]
    for path, item in tools.items():
        parts.append(_tool(path, item, fields, base_url))
    parts.append("<h2>Other routes</h2>")
    for path, item in others.items():
        parts.append(_route(path, item, fields))
    parts.append(_errors(doc, fields))
    parts.append("</body></html>")
    return "\n".join(parts)


def _refused(tools: Mapping[str, str]) -> list[str]:
    if not tools:
        return []
    rows = "".join(f"<li><code>{_e(name)}</code>: {_inline(why)}</li>" for name, why in tools.items())
    return [f"<p>Tools the served model cannot run (answered 422 <code>unsupported_by_model</code>):</p><ul>{rows}</ul>"]


def _tool(path: str, item: Mapping[str, Any], fields: Fields, base_url: str) -> str:
    post = item["post"]
    name = _tool_name(path)
    params_ref = post["requestBody"]["content"]["application/json"]["schema"]
    event = fields.resolve(post["responses"]["200"]["content"]["text/event-stream"]["schema"])
    by_event = {
        option["properties"]["event"]["const"]: option["properties"]["data"]["contentSchema"]
        for option in event.get("oneOf", ())
    }
    out = [
        f'<h2 id="{_anchor(path)}">{_e(name)}</h2>',
        f"<p><span class=method>POST</span> <code>{_e(path)}</code> · <span class=method>GET</span> <code>{_e(path)}</code></p>",
        *(f"<p>{_inline(p)}</p>" for p in post.get("description", "").split("\n\n") if p.strip()),
        _object_table("Params", params_ref, fields),
        _object_table("Result: the data event", by_event["data"], fields),
    ]
    if "partial" in by_event:
        out.append(_object_table("Partial: each partial event, as the job runs", by_event["partial"], fields))
    example = _example(fields.resolve(params_ref), fields)
    out.append("<h3>Try it</h3><pre>" + _e(f"curl -N {base_url}{path} -d '{json.dumps(example)}'") + "</pre>")
    return "\n".join(out)


def _object_table(caption: str, ref: Any, fields: Fields) -> str:
    """A table of an object's properties, then one for each object nested in them."""
    node = fields.resolve(ref)
    props = node.get("properties") or {}
    if not props:
        return f"<h3>{_e(caption)}</h3><p class=muted>{_e(fields.type_of(node))}</p>"
    required = set(node.get("required", ()))
    rows: list[tuple[str, str, str, str]] = []
    nested: list[dict[str, Any]] = []
    for key, prop in props.items():
        prop = fields.resolve(prop)
        flag = " <span class=required>required</span>" if key in required else ""
        default = f"<code>{_e(json.dumps(prop['default']))}</code>" if "default" in prop else ""
        rows.append((f"<code>{_e(key)}</code>{flag}", _e(fields.type_of(prop)), default, _inline(fields.description(prop))))
        nested += fields.objects_in(prop)
    # A column no field fills (a result's defaults, say) is left out.
    shown = [i for i in range(4) if i < 2 or any(row[i] for row in rows)]
    heads = ("field", "type and limits", "default", "meaning")
    table = (
        f"<h3>{_e(caption)}</h3><table><tr>{''.join(f'<th>{heads[i]}</th>' for i in shown)}</tr>"
        + "".join(
            "<tr>" + "".join(f"<td class=name>{row[i]}</td>" if i == 0 else f"<td>{row[i]}</td>" for i in shown) + "</tr>"
            for row in rows
        )
        + "</table>"
    )
    return table + "".join(_object_table(f"{n.get('title', 'object')}: in {caption.split(':')[0].lower()}", n, fields) for n in nested)


def _example(params: Mapping[str, Any], fields: Fields) -> dict[str, Any]:
    """The smallest params to start from: each required field (or, with none, the first) with a value of its type."""
    keys = list(params.get("required", ())) or list(params.get("properties", {}))[:1]
    return {key: _sample(fields.resolve(params["properties"][key]), fields) for key in keys}


def _sample(node: Mapping[str, Any], fields: Fields) -> Any:
    options = [fields.resolve(o) for o in node.get("anyOf", ()) if fields.resolve(o).get("type") != "null"]
    if options:
        return _sample(options[0], fields)
    if "enum" in node:
        return node["enum"][0]
    kind = node.get("type")
    if isinstance(kind, list):  # a type written as a list of types: its first that is not null
        kind = next((k for k in kind if k != "null"), None)
    samples: dict[str, Callable[[], Any]] = {
        "string": lambda: "The capital of France is",
        "integer": lambda: max(int(node.get("minimum", 1)), 1),
        "number": lambda: node.get("minimum", 1.0),
        "boolean": lambda: True,
        "array": lambda: [_sample(fields.resolve(node.get("items", {})), fields)] * max(1, node.get("minItems", 1)),
        "object": lambda: _example(node, fields),
    }
    return samples[kind]() if kind in samples else None


def _route(path: str, item: Mapping[str, Any], fields: Fields) -> str:
    out = [f'<h3 id="{_anchor(path)}"><code>{_e(path)}</code></h3>']
    for method, op in item.items():
        out.append(f"<p><span class=method>{method.upper()}</span> {_inline(op.get('summary', ''))}</p>")
        params = op.get("parameters", ())
        if params:
            out.append(
                "<table><tr><th>parameter</th><th>in</th><th>meaning</th></tr>"
                + "".join(
                    f"<tr><td class=name><code>{_e(p['name'])}</code></td><td>{_e(p['in'])}</td>"
                    f"<td>{_inline(p.get('description', fields.type_of(p.get('schema', {}))))}</td></tr>"
                    for p in params
                )
                + "</table>"
            )
        out.append(
            "<table><tr><th>status</th><th>answer</th></tr>"
            + "".join(
                f"<tr><td>{_e(status)}</td><td>{_inline(fields.resolve(response).get('description', ''))}</td></tr>"
                for status, response in op["responses"].items()
            )
            + "</table>"
        )
    return "\n".join(out)


def _errors(doc: Mapping[str, Any], fields: Fields) -> str:
    responses = doc.get("components", {}).get("responses", {})
    rows = "".join(
        f"<tr><td>{_e(status)}</td><td>{_inline(response.get('description', ''))}</td></tr>"
        for status, response in responses.items()
    )
    return (
        '<h2 id="errors">Errors</h2><p>A request refused before its job starts gets an HTTP status and the body '
        '<code>{"error": {"code", "message", "retryable", "field"}}</code>, <code>field</code> naming the param at fault. '
        "Once the stream is open, a failure is its one <code>error</code> event, with the same fields.</p>"
        f"<table><tr><th>status</th><th>codes</th></tr>{rows}</table>"
    )


def _tool_name(path: str) -> str:
    return path.strip("/").split("/")[0]


def _anchor(path: str) -> str:
    """A tool's section is its name; another route's, its path spelt with dashes."""
    if path.endswith("/run"):
        return _tool_name(path)
    return "route-" + "".join(c if c.isalnum() else "-" for c in path.strip("/"))


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _inline(text: str) -> str:
    """Escaped text with its `code` spans kept as code."""
    pieces = _e(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def endpoint(openapi: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """The `GET /docs` handler, over the `GET /openapi.json` handler (which keeps the document current)."""

    built: list[Any] = [None, ""]  # the document and address last rendered, and their page

    async def docs(request: Request) -> Response:
        # The commands call the gateway where the reader found it (behind a proxy: its Host).
        key = ((await openapi(request)).body, str(request.base_url).rstrip("/"))
        if key != built[0]:
            built[:] = [key, page(json.loads(key[0]), key[1])]
        return HTMLResponse(built[1])

    return docs
