"""Input files as records: FASTA sequences or JSONL params, for `streamgate run --input`.

A record is one job to run: an id unique within its file, and either a
sequence (FASTA) or a JSON object of params (JSONL). `read_records(path)`
picks the format by the file's extension (`read_fasta`, `read_jsonl`);
`.gz` files are read through gzip.

FASTA: `>id description` opens a record, the lines up to the next header
are its sequence, joined as they are (line ends and the whitespace around
each line dropped, nothing else: the server cleans and checks sequences).
Blank lines may go anywhere; Windows line ends and a byte-order mark are
fine. A sequence line before the first header, a header with no id, and an
id given twice are errors naming the line.

JSONL: each non-empty line is a JSON object of params. Its `id` key (a
string or an integer), when the tool has no `id` param of its own, is the
record's id and is taken out of the params; otherwise the record's id is
its line number (from 1), as a string.

Every problem is a `RecordError`, whose message names the file and line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

FASTA_EXTENSIONS = (".fasta", ".fa", ".faa", ".fna", ".fas")
JSONL_EXTENSIONS = (".jsonl", ".ndjson")
FORMATS = ("fasta", "jsonl")


@dataclass(frozen=True)
class Record:
    """One record of an input file: its id, the line it starts on, and its sequence (FASTA) or params (JSONL)."""

    id: str
    line: int
    sequence: str | None = None
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)


class RecordError(ValueError):
    """An input file that cannot be read as records: the message names the file and the line."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, message: str) -> None:
        self.path, self.line = os.fspath(path), line
        super().__init__(f"{self.path}:{line}: {message}" if line is not None else f"{self.path}: {message}")


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """`fasta` or `jsonl` from the file's extension (`.gz` after it allowed); None when it says neither."""
    name = os.fspath(path).lower()
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    if name.endswith(FASTA_EXTENSIONS):
        return "fasta"
    if name.endswith(JSONL_EXTENSIONS):
        return "jsonl"
    return None


def read_records(
    path: str | os.PathLike[str], input_format: str | None = None, *, id_key: bool = True
) -> list[Record]:
    """The records of `path`, in the format given or else the one its extension says.

    `id_key` is read_jsonl's: whether a JSONL line's `id` key names the record.
    """
    fmt = input_format or detect_format(path)
    if fmt is None:
        raise RecordError(
            path, None,
            f"cannot tell the format from the name: give --input-format fasta or jsonl, or name the file "
            f"{'/'.join(FASTA_EXTENSIONS + JSONL_EXTENSIONS)} (optionally .gz)",
        )
    if fmt == "fasta":
        return read_fasta(path)
    if fmt == "jsonl":
        return read_jsonl(path, id_key=id_key)
    raise ValueError(f"unknown input format {fmt!r}; one of {', '.join(FORMATS)}")


def read_fasta(path: str | os.PathLike[str]) -> list[Record]:
    """The records of a FASTA file, in file order: id, description, and the sequence lines joined."""
    records: list[Record] = []
    seen: dict[str, int] = {}
    header: tuple[str, str, int] | None = None  # id, description, line of the record being read
    parts: list[str] = []

    def close() -> None:
        if header is not None:
            records.append(Record(header[0], header[2], "".join(parts), header[1]))

    for number, line in _lines(path):
        text = line.strip()
        if not text:
            continue
        if text.startswith(">"):
            close()
            name, description = (text[1:].split(None, 1) + ["", ""])[:2]
            if not name:
                raise RecordError(path, number, "a header with no id: write it as >ID, then a description if you like")
            if name in seen:
                raise RecordError(path, number, f"the id {name!r} again (first on line {seen[name]}): ids must be unique")
            seen[name] = number
            header, parts = (name, description.strip(), number), []
        elif header is None:
            raise RecordError(path, number, "a sequence before any header: each record starts with a >ID line")
        else:
            parts.append(text)
    close()
    return records


def read_jsonl(path: str | os.PathLike[str], *, id_key: bool = True) -> list[Record]:
    """The records of a JSONL file: each non-empty line a JSON object of params.

    With `id_key` (the tool has no `id` param of its own), a line's `id` key,
    a string or an integer, is its record's id and leaves the params; a line
    without one, and every line without `id_key`, is named by its line number.
    """
    records: list[Record] = []
    seen: dict[str, int] = {}
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            params = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(path, number, f"not valid JSON: {exc}") from None
        if not isinstance(params, dict):
            raise RecordError(path, number, f"expected a JSON object of params, got {type(params).__name__}")
        name = str(number)
        if id_key and "id" in params:
            given = params.pop("id")
            if isinstance(given, bool) or not isinstance(given, (str, int)) or given == "":
                raise RecordError(path, number, f"the id must be a non-empty string or an integer, got {given!r}")
            name = str(given)
        if name in seen:
            raise RecordError(path, number, f"the id {name!r} again (first on line {seen[name]}): ids must be unique")
        seen[name] = number
        records.append(Record(name, number, params=params))
    return records


def _lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """The lines of a text file (UTF-8, gzip when named .gz), numbered from 1, line ends dropped."""
    try:
        stream: IO[str]
        if os.fspath(path).lower().endswith(".gz"):
            stream = io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
        else:
            stream = open(path, encoding="utf-8-sig")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise RecordError(path, None, f"cannot read it: {exc.strerror or exc}") from None
    with stream:
        number = 0
        try:
            # Universal newlines: \n, \r\n and \r all end a line.
            for number, line in enumerate(stream, 1):
                yield number, line.rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise RecordError(path, number + 1, f"not UTF-8 text: {exc.reason}") from None
        except (OSError, EOFError) as exc:  # a corrupt or truncated .gz
            raise RecordError(path, number + 1, f"cannot read it: {exc}") from None
