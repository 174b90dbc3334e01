"""`GET /docs`: the API as a page to read, built from the OpenAPI document, with nothing from elsewhere."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from tests.conftest import run_stream


class Page(HTMLParser):
    """The page's anchors, outside references, and tags left open."""

    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.loads: list[str] = []  # what a browser would fetch
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"] or "")
        if tag == "a" and a.get("href"):
            self.links.append(a["href"] or "")
        if tag in ("script", "link", "img", "iframe") or "src" in a:
            self.loads.append(f"<{tag} {a}>")
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()


@pytest.fixture(scope="module")
def page(server: Any) -> tuple[str, Page]:
    answer = httpx.get(f"{server.url}/docs")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/html")
    parsed = Page()
    parsed.feed(answer.text)
    parsed.close()
    return answer.text, parsed


def test_the_page_is_whole_and_loads_nothing_from_elsewhere(page: tuple[str, Page]) -> None:
    text, parsed = page
    assert parsed.open == [], f"tags left open: {parsed.open}"
    assert parsed.loads == []  # no script, stylesheet, image or frame: the page is one document
    assert "@import" not in text and "url(" not in text
    for href in parsed.links:
        assert href.startswith("#") and href[1:] in parsed.ids or href in ("/", "/openapi.json"), href


def test_every_tool_is_there_with_its_params_limits_and_defaults(server: Any, page: tuple[str, Page]) -> None:
    text, parsed = page
    tools = httpx.get(f"{server.url}/tools").json()
    for tool in tools:
        if tool["unsupported"]:  # listed apart, with the reason
            assert f"<li><code>{tool['name']}</code>: {html.escape(tool['unsupported'])}" in text
            continue
        assert tool["name"] in parsed.ids, tool["name"]
        for name in tool["params_schema"].get("properties", {}):
            assert f"<code>{name}</code>" in text, (tool["name"], name)
    generate = text[text.index('id="generate"') : text.index('id="loglikelihood"')]
    assert f"integer (1 ≤ x ≤ {Settings().max_tokens})" in html.unescape(generate)  # the server's cap, applied
    assert "<code>16</code>" in generate  # max_tokens' default
    assert "ChatMessage" in generate and "one of &quot;assistant&quot;, &quot;system&quot;, &quot;user&quot;" in generate
    assert "Partial" in generate and "token_ids" in generate
    for code in ("invalid_params", "unsupported_by_model", "idempotency_key_reused", "queue_full"):
        assert f"<code>{code}</code>" in text


def test_each_try_it_command_runs(server: Any, page: tuple[str, Page]) -> None:
    text, _ = page
    commands = re.findall(r"curl -N (\S+)/(\w+)/run -d '(.*?)'</pre>", html.unescape(text))
    assert {url for url, _, _ in commands} == {server.url}  # where the page was read from
    commands = [(tool, body) for _, tool, body in commands]
    assert {tool for tool, _ in commands} == {t["name"] for t in httpx.get(f"{server.url}/tools").json() if not t["unsupported"]}
    for tool, body in commands:
        s = run_stream(server.url, tool, json.loads(body))
        assert s.status == 200 and s.terminal["event"] == "data", (tool, body, s.raw[-300:])
