"""What the `streamgate` command shows a person at a terminal while it runs (stderr): a job's
statuses, logs, progress bar and streamed text (`RunView`), and a tool described from `GET /tools`.
The views of finished results are in gateway/cli/render.py."""

from __future__ import annotations

import os
import sys
from typing import Any

from gateway.server.schema_text import Fields


def printable(text: str) -> str:
    """`text` safe to show on a terminal: control characters but newline and tab as visible symbols.

    Generated text is arbitrary: an escape sequence in it would be run by the
    terminal, a carriage return would overwrite the line. C0 controls become
    their Unicode pictures (␛, ␍), DEL ␡, and C1 controls, which some
    terminals obey too, �. The JSON result keeps the exact text.
    """
    return text.translate(_CONTROL_PICTURES)


_CONTROL_PICTURES = {
    **{c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"},
    0x7F: 0x2421,
    **{c: 0xFFFD for c in range(0x80, 0xA0)},
}


class RunView:
    """What `run` shows on stderr while a job runs: statuses, logs, a progress bar, streamed text.

    One streamed text is written as it comes, token by token, and takes the
    bar's place: the text is itself the progress, and a bar kept below text
    that wraps and grows would need the cursor moved back into the text for
    every token, which breaks on wide characters and on a resized window.
    Several texts (a job of several prompts, partials with their `index`)
    arrive interleaved token by token, so they are shown line by line
    instead, each labelled `[index]`, wrapped at the terminal's width, with
    the bar kept below them. The bar is drawn only on a terminal: piped, its
    carriage-return redraws would be mixed into the text.
    """

    def __init__(self, err: Any, texts: int, quiet: bool) -> None:
        self.err, self.quiet = err, quiet
        self.tty = err.isatty()
        self.labelled = texts > 1
        self.bar: Any = None
        self.streamed = False  # one text has streamed: no bar from then on
        self.mid_line = False  # the cursor is after streamed text, not at a line's start
        self.first_index: int | None = None
        self.lines: dict[int, str] = {}  # labelled: each text's line not yet shown

    def status(self, frame: dict[str, Any]) -> None:
        progress = frame.get("progress")
        if progress:
            self._progress(progress)
            return
        line = frame["status"]
        if frame.get("position") is not None:
            line += f" (position {frame['position']} of {frame.get('queue_size', '?')})"
        if frame.get("message"):
            line += f": {frame['message']}"
        self.line(line)

    def log(self, frame: dict[str, Any]) -> None:
        self.line(f"[{frame['level']}] {frame['message']}")

    def line(self, text: str) -> None:
        """Show a whole line above the bar, after any text streamed so far."""
        if self.quiet:
            return
        self._end_line()
        if self.bar is not None:
            self.bar.clear()
        self.err.write(text + "\n")
        self.err.flush()
        if self.bar is not None:
            self.bar.refresh()

    def partial(self, data: Any) -> None:
        if self.quiet or not isinstance(data, dict) or not isinstance(data.get("text"), str):
            return
        index = data.get("index") if isinstance(data.get("index"), int) else 0
        if self.first_index is None:
            self.first_index = index
        if not self.labelled and index != self.first_index:
            # More texts than the params said: label them from here on.
            self.labelled = True
        if self.labelled:
            self._add_line_text(index, data["text"])
            return
        if self.bar is not None:
            self.bar.close()  # leave=False: clears its line
            self.bar = None
        text = printable(data["text"])
        if text:
            self.streamed = True
            self.err.write(text)
            self.err.flush()
            self.mid_line = not text.endswith("\n")

    def finish(self) -> None:
        """Show what is left of the texts and take the bar away: the job ended."""
        for index in sorted(self.lines):
            if self.lines[index]:
                self.line(f"[{index}] {self.lines[index]}")
        self.lines.clear()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._end_line()

    def _progress(self, progress: dict[str, Any]) -> None:
        if self.quiet or not self.tty or self.streamed:
            return
        if self.bar is None:
            from tqdm import tqdm

            self._end_line()
            self.bar = tqdm(total=progress.get("total"), unit=progress.get("unit") or "it", file=self.err, leave=False)
        self.bar.n = progress["done"]
        self.bar.refresh()

    def _add_line_text(self, index: int, text: str) -> None:
        width = max(20, terminal_width(self.err) - len(f"[{index}] "))
        pending = self.lines.get(index, "") + printable(text)
        while True:
            head, newline, rest = pending.partition("\n")
            if newline:
                line, pending = head, rest
            elif len(head) > width:
                # Break at the last space that fits, or mid-word in a word longer than the line.
                cut = head.rfind(" ", 0, width + 1)
                cut = cut + 1 if cut > 0 else width
                line, pending = head[:cut].rstrip(" "), head[cut:]
            else:
                break
            self.line(f"[{index}] {line}" if line else f"[{index}]")
        self.lines[index] = pending

    def _end_line(self) -> None:
        if self.mid_line:
            self.err.write("\n")
            self.err.flush()
            self.mid_line = False


def terminal_width(stream: Any = None) -> int:
    """The width of the terminal `stream` (stderr by default) writes to; else $COLUMNS, else 100."""
    import shutil

    try:
        return os.get_terminal_size((stream or sys.stderr).fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal: a pipe, a file, a test's buffer
        return shutil.get_terminal_size((100, 24)).columns


def describe_tool(entry: dict[str, Any], width: int = 100) -> str:
    """One tool of `GET /tools` for a person: what it does, whether it streams, and each param."""
    import textwrap

    lines = [entry["name"]]
    for paragraph in (entry.get("description") or "").strip().splitlines():
        lines += textwrap.wrap(paragraph, max(40, width - 2), initial_indent="  ", subsequent_indent="  ") or [""]
    lines += ["", f"streams partial results: {'yes' if entry.get('streams_partial') else 'no'}"]
    unsupported = entry.get("unsupported")
    lines.append(f"runs on this model: no: {unsupported}" if unsupported else "runs on this model: yes")
    schema = entry.get("params_schema") or {}
    fields = Fields(schema, width).of(schema, indent=2)
    lines += ["", "params:", *fields] if fields else ["", "params: none"]
    return "\n".join(lines)
