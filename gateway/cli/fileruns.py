"""`streamgate run TOOL --input FILE --output OUT`: a file of records through a tool, one job each.

Before any job: the tool and its params schema (GET /tools), the records (a
bad file, duplicate ids, no param for FASTA sequences: exit 2) and what OUT
holds already (records with a result are skipped). The records run through
`Client.run_many`, a bounded number at a time; each outcome is appended to OUT
as it comes, so that a crash loses nothing done, and OUT is rewritten in input
order at the end. The exit codes are `streamgate run`'s: 0 every record has a
result, 1 some failed, 2 the run cannot start, 3 the gateway cannot be reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Any

import click

from gateway.client import Client

MAX_SHOWN_FAILURES = 10  # failures told on stderr one by one; the rest only counted (all are in OUT)


class FileRun:
    """`run TOOL --input FILE --output OUT`: a job per record, `concurrency` at a time, each outcome a line of OUT.

    Before any job: the tool and its params schema (GET /tools), the records
    (a bad file, duplicate ids, no param for FASTA sequences: exit 2) and
    what OUT holds already (records with a result are skipped). Lines are
    appended to OUT as records end, so that a crash loses nothing done, and
    OUT is rewritten in input order at the end.
    """

    def __init__(
        self, tool: str, params: dict[str, Any] | None, query: list[tuple[str, str]] | None, model: str | None,
        url: str, token: str | None, quiet: bool, concurrency: int | None, out: str | None = None,
    ) -> None:
        self.tool, self.given, self.query, self.model = tool, params, query, model
        self.url, self.token, self.quiet, self.concurrency = url, token, quiet, concurrency
        self.out = out  # where a record's result files go: OUT/<record id>/<name>
        self._folders: dict[str, str] = {}  # each record's folder under OUT, by id: two ids never share one

    def run(self, input_path: str | None, output_path: str | None, input_format: str | None, field: str | None) -> int:
        """Run the batch; the exit code."""
        import httpx

        from gateway.cli import records
        from gateway.client import HttpError

        if input_path is None:
            raise click.UsageError("--output goes with --input FILE: the records to run")
        if output_path is None:
            raise click.UsageError("--input needs --output OUT: the JSONL file the outcomes go to")
        fmt = input_format or records.detect_format(input_path)
        if fmt is None:
            raise click.UsageError(
                f"cannot tell the format of {input_path} from its name: give --input-format fasta or jsonl"
            )
        if field is not None and fmt != "fasta":
            raise click.UsageError("--field is for FASTA input: each JSONL line names its own params")
        if os.path.abspath(input_path) == os.path.abspath(output_path):
            raise click.UsageError("--output must be another file than --input")
        if output_path.lower().endswith(".gz"):
            raise click.UsageError("--output is written as plain JSONL, line by line: give it a name without .gz")
        if not os.path.isfile(input_path):
            return _fail(f"cannot read {input_path}: no such file")
        with Client(self.url, headers={"Authorization": f"Bearer {self.token}"} if self.token else None) as client:
            try:
                entry = self._tool_entry(client)
                if isinstance(entry, int):
                    return entry
                concurrency = self.concurrency or _default_concurrency(client)
            except HttpError as exc:
                return _fail(str(exc))
            except httpx.HTTPError as exc:
                return _fail(f"cannot reach {self.url}: {exc}", 3)
            schema = entry.get("params_schema") or {}
            properties = schema.get("properties") or {}
            try:
                base = self._base_params(schema)
                recs = records.read_records(input_path, fmt, id_key="id" not in properties)
                fill = _sequence_field(self.tool, schema, field) if fmt == "fasta" else None
                results = _Results(output_path, [r.id for r in recs])
            except (records.RecordError, _BatchError) as exc:
                return _fail(str(exc))
            if results.dropped:  # said even with --quiet: lines of the file are going away
                shown = ", ".join(results.dropped[:5]) + (", …" if len(results.dropped) > 5 else "")
                click.echo(
                    f"warning: {output_path} holds {len(results.dropped)} record(s) whose ids are not in "
                    f"{input_path} ({shown}): they are left out of it",
                    err=True,
                )
            for record in recs if self.out is not None else ():  # named in input order: the same each run
                self._folder(record.id)
            todo = [r for r in recs if r.id not in results.done]
            skipped = len(recs) - len(todo)
            if not recs and not self.quiet:
                click.echo(f"warning: {input_path} holds no records", err=True)

            named = fill is not None and fill[1] and "names" in properties and "names" not in base

            def params_of(record: records.Record) -> dict[str, Any]:
                if fill is not None:
                    name, as_list = fill
                    params = {**base, name: [record.sequence] if as_list else record.sequence}
                    if named and TRACK_NAME.fullmatch(record.id):  # the record's id names its tracks in result files
                        params["names"] = [record.id]
                    return params
                return {**base, **record.params}

            outcomes = client.run_many(self.tool, map(params_of, todo), concurrency=concurrency, ordered=False)
            return self._drive(client, outcomes, todo, skipped, results)

    def _drive(self, client: Client, outcomes: Any, todo: list[Any], skipped: int, results: _Results) -> int:
        """Write each outcome as it comes, with the progress bar; the exit code."""
        try:
            results.begin()
        except OSError as exc:
            return _fail(f"cannot write {results.path}: {exc.strerror or exc}")
        succeeded = failed = 0
        code: int | None = None
        bar = _BatchBar(self.tool, len(todo), skipped, self.quiet)
        try:
            with contextlib.closing(outcomes):
                for outcome in outcomes:
                    record = todo[outcome.index]
                    stop = self._fatal(outcome.error)
                    if stop is not None:
                        bar.close()
                        code, message = stop
                        click.echo(f"error: {message}", err=True)
                        break
                    line = {"id": record.id, "result": outcome.result} if outcome.ok else None
                    if line is not None and files_of(outcome.result):
                        line = self._fetch_files(client, record.id, outcome, line)
                    if line is not None:
                        succeeded += 1
                        results.add(record.id, line)
                    else:
                        failed += 1
                        error = _error_fields(outcome.error)
                        results.add(record.id, {"id": record.id, "error": error})
                        if failed <= MAX_SHOWN_FAILURES:
                            more = " (more failures are only counted; all are in the output)" if failed == MAX_SHOWN_FAILURES else ""
                            bar.write(f"failed: {record.id}: {_error_text(error)}{more}")
                    bar.advance(succeeded, failed)
        except KeyboardInterrupt:
            code = 130
        finally:
            bar.close()
            results.finish()
        left = len(todo) - succeeded - failed
        if code == 130:
            click.echo(f"cancelled: {left} record(s) not run; run the same command again to go on", err=True)
            return code
        if code is not None:
            click.echo(f"stopped: {left} record(s) not run; run the same command again to go on", err=True)
            return code
        if not self.quiet:
            before = f", {skipped} done before" if skipped else ""
            click.echo(f"{succeeded} succeeded, {failed} failed{before}: {results.path}", err=True)
        return 1 if failed else 0

    def _fetch_files(self, client: Client, record_id: str, outcome: Any, line: dict[str, Any]) -> dict[str, Any] | None:
        """The record's result files into OUT/<record id>/ (`--out`), the line naming where each went;
        None (the record failed, to run again) if one could not be fetched, `outcome.error` saying why.
        Without --out the line keeps the result alone: its files stay on the gateway for its retention."""
        if self.out is None:
            return line
        folder = os.path.join(self.out, self._folder(record_id))
        paths = {}
        try:
            os.makedirs(folder, exist_ok=True)
            for file in files_of(outcome.result):
                path = os.path.join(folder, safe_name(file["name"]))
                client.download(path, outcome.job_id, file["name"])
                paths[file["name"]] = path
        except Exception as exc:  # noqa: BLE001 (this record's outcome: it runs again next time)
            outcome.error = exc
            return None
        return {**line, "files": paths}

    def _folder(self, record_id: str) -> str:
        """The record's folder name under OUT: its id made safe, and numbered where another id made
        the same (`a|b` and `a_b`)."""
        if record_id not in self._folders:
            taken = set(self._folders.values())
            name = base = safe_name(record_id)
            n = 1
            while name in taken:
                n += 1
                name = f"{base}-{n}"
            self._folders[record_id] = name
        return self._folders[record_id]

    def _fatal(self, error: BaseException | None) -> tuple[int, str] | None:
        """An error that no record of this run would escape (unauthorized, forbidden, unknown tool or
        model; the gateway out of reach) stops the run: its exit code and why; else None."""
        import httpx

        from gateway.client import HttpError

        if isinstance(error, HttpError) and error.status in (401, 403, 404):
            return 2, str(error)
        if isinstance(error, httpx.HTTPError):
            return 3, f"cannot get results from {self.url}: {error}"
        return None

    def _tool_entry(self, client: Any) -> dict[str, Any] | int:
        """The tool's entry of GET /tools (for --model's model), or the exit code of a tool it cannot run."""
        listed = client.tools(self.model)
        entry = next((t for t in listed if t["name"] == self.tool), None)
        if entry is None:
            return _fail(f"unknown tool {self.tool}; the server has: {', '.join(t['name'] for t in listed)}")
        if entry.get("unsupported"):
            return _fail(str(entry["unsupported"]))
        return entry

    def _base_params(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The params every record gets: --json's, or the KEY=VALUE pairs typed by the tool's schema; and --model."""
        properties = schema.get("properties") or {}
        if self.given is not None:
            base = dict(self.given)
            unknown = [key for key in base if key not in properties]
            if unknown:
                raise _BatchError(f"{self.tool} has no param {unknown[0]}; its params: {', '.join(properties)}")
        else:
            base = _typed_pairs(self.tool, self.query or [], schema)
        if self.model is not None:
            base["model"] = self.model
        return base


class _BatchError(Exception):
    """A batch run that cannot start: exit 2 with the message."""


# What a tool's `names` takes (a chromosome's name in a bigWig: gateway/tools/sae_annotate.py).
TRACK_NAME = re.compile(r"[A-Za-z0-9_.:|-]{1,128}")


def files_of(result: Any) -> list[dict[str, Any]]:
    files = result.get("files") if isinstance(result, dict) else None
    return files if isinstance(files, list) else []


def safe_name(name: str) -> str:
    """`name` as one path component: what is not a letter, digit, '.', '_' or '-' becomes '_'."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    return safe or "_"


def _fail(message: str, code: int = 2) -> int:
    click.echo(f"error: {message}", err=True)
    return code


def _default_concurrency(client: Any) -> int:
    """The gateway's max batch size (GET /readyz: local backends say it), else 8."""
    try:
        size = client.ready().get("max_batch_size")
    except Exception:  # noqa: BLE001 (a default only: the tools were listed, so the run can go on)
        return 8
    return size if isinstance(size, int) and size >= 1 else 8


def _schema_alternatives(schema: Any, root: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives a value of `schema` may take, `$ref`s to `root`'s `$defs` followed, null left out."""
    found: list[dict[str, Any]] = []
    pending = [schema]
    while pending:
        part = pending.pop(0)
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("$ref"), str) and part["$ref"].startswith("#/$defs/"):
            pending.append((root.get("$defs") or {}).get(part["$ref"].rsplit("/", 1)[1]))
        elif "anyOf" in part or "oneOf" in part:
            pending.extend(part.get("anyOf", []) + part.get("oneOf", []))
        elif part.get("type") != "null":
            found.append(part)
    return found


def _text_kind(schema: Any, root: dict[str, Any]) -> str | None:
    """`string` for a param that takes a string, `list` for a list of strings, else None."""
    alternatives = _schema_alternatives(schema, root)
    if any(a.get("type") == "string" and "enum" not in a for a in alternatives):
        return "string"
    for a in alternatives:
        if a.get("type") == "array":
            items = _schema_alternatives(a.get("items"), root)
            if items and all(i.get("type") == "string" and "enum" not in i for i in items):
                return "list"
    return None


def _sequence_field(tool: str, schema: dict[str, Any], field: str | None) -> tuple[str, bool]:
    """The param FASTA sequences fill, and whether it takes a list: --field, else the one required text param."""
    properties = schema.get("properties") or {}
    texts = {name: kind for name, prop in properties.items() if name != "model" and (kind := _text_kind(prop, schema))}
    if field is not None:
        if field not in texts:
            named = f"{tool} has no param {field}" if field not in properties else f"{tool}'s {field} takes no text"
            return _no_field(f"{named}; its text params: {', '.join(texts) or 'none'}")
        return field, texts[field] == "list"
    required = [name for name in schema.get("required") or [] if name in texts]
    if len(required) == 1:
        return required[0], texts[required[0]] == "list"
    if required:
        return _no_field(f"{tool} requires several text params: {', '.join(required)}; give --field NAME for the "
                         f"sequences, and the others as KEY=VALUE or --json")
    return _no_field(f"{tool} requires no text param for the sequences to fill; its text params: "
                     f"{', '.join(texts) or 'none'}; give --field NAME")


def _no_field(message: str) -> Any:
    raise _BatchError(f"cannot tell which param takes each sequence: {message}")


def _typed_pairs(tool: str, query: list[tuple[str, str]], schema: dict[str, Any]) -> dict[str, Any]:
    """KEY=VALUE pairs as a JSON body, typed as the tool's schema says (a list param repeated, numbers, booleans)."""
    properties = schema.get("properties") or {}
    params: dict[str, Any] = {}
    for key, value in query:
        if key not in properties:
            raise _BatchError(f"{tool} has no param {key}; its params: {', '.join(properties)}")
        alternatives = _schema_alternatives(properties[key], schema)
        lists = [a for a in alternatives if a.get("type") == "array"]
        if lists:
            params.setdefault(key, []).append(_typed(key, value, _schema_alternatives(lists[0].get("items"), schema)))
        elif key in params:
            raise _BatchError(f"{key} given more than once; it takes one value")
        else:
            params[key] = _typed(key, value, alternatives)
    return params


def _typed(key: str, value: str, alternatives: list[dict[str, Any]]) -> Any:
    types = {a.get("type") for a in alternatives}
    if not types or types & {"string", None}:
        return value  # text, or a schema this does not read: the server says whether it fits
    if "integer" in types:
        with contextlib.suppress(ValueError):
            return int(value)
    if "number" in types:
        with contextlib.suppress(ValueError):
            return float(value)
    if "boolean" in types and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise _BatchError(f"{key}: expected {' or '.join(sorted(t for t in types if t))}, got {value!r}")


def _error_fields(error: BaseException | None) -> dict[str, Any]:
    """A record's error as its output line has it: code, message, and the HTTP status (and field) of a refusal."""
    from gateway.client import HttpError, JobError, StreamEndedError

    if isinstance(error, HttpError):
        fields: dict[str, Any] = {"code": error.code, "message": error.message, "status": error.status}
        if error.field:
            fields["field"] = error.field
        return fields
    if isinstance(error, JobError):
        return {"code": error.code, "message": error.message}
    if isinstance(error, StreamEndedError):
        return {"code": "stream_ended", "message": str(error)}
    return {"code": "client_error", "message": f"{type(error).__name__}: {error}"}


def _error_text(error: dict[str, Any]) -> str:
    status = f"{error['status']} " if "status" in error else ""
    return f"{status}{error['code']}: {error['message']}"


class _Results:
    """The --output file of a batch run: what it holds from before, lines appended as records end,
    then rewritten in input order.

    A line with a `result` marks its record done; one with an `error` is kept
    until the record runs again. A last line cut short (a crash mid-write) is
    left out; a line of records not in the input is dropped (`dropped`); any
    other line that is not an outcome stops the run before it starts, so that
    a file that is no run's output is never overwritten.
    """

    def __init__(self, path: str, ids: list[str]) -> None:
        self.path, self.ids = path, ids
        self.lines: dict[str, str] = {}  # id → its outcome's JSON line
        self.done: set[str] = set()  # ids with a result from before
        self.dropped: list[str] = []
        self._file: Any = None
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise _BatchError(f"cannot write {path}: no such folder")
        if os.path.exists(path):
            self._load(set(ids))

    def _load(self, known: set[str]) -> None:
        try:
            with open(self.path, encoding="utf-8", newline="") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise _BatchError(f"cannot read {self.path}: {exc}") from None
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text:
                continue
            try:
                outcome = json.loads(text)
            except json.JSONDecodeError:
                if number == len(lines):  # no newline after it: cut short by a crash
                    continue
                raise _BatchError(f"{self.path}:{number}: not JSON; is it the output of a batch run? "
                                  f"Give another --output, or remove the line") from None
            if not (isinstance(outcome, dict) and "id" in outcome and ("result" in outcome or "error" in outcome)):
                raise _BatchError(f"{self.path}:{number}: not an outcome ({{\"id\", \"result\" or \"error\"}}); "
                                  f"is it the output of a batch run? Give another --output")
            name = str(outcome["id"])
            if name not in known:
                self.dropped.append(name)
            elif "result" in outcome:
                self.lines[name] = text
                self.done.add(name)
            elif name not in self.done:
                self.lines[name] = text

    def begin(self) -> None:
        """Rewrite what is kept from before, in input order, and open the file to append outcomes to."""
        self._rewrite()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by finish)

    def add(self, name: str, outcome: dict[str, Any]) -> None:
        line = json.dumps(outcome, ensure_ascii=False, separators=(",", ":"))
        self.lines[name] = line
        self._file.write(line + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._rewrite()

    def _rewrite(self) -> None:
        import tempfile

        folder = os.path.dirname(os.path.abspath(self.path))
        fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.path)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.writelines(self.lines[name] + "\n" for name in self.ids if name in self.lines)
            os.replace(temp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise


class _BatchBar:
    """The batch's one progress bar on stderr (records run, rate, ETA; done and failed), on a terminal only."""

    def __init__(self, tool: str, total: int, skipped: int, quiet: bool) -> None:
        self.quiet = quiet
        self.bar: Any = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            desc = f"{tool} ({skipped} done before)" if skipped else tool
            self.bar = tqdm(
                total=total, desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True, postfix={"done": 0, "failed": 0}
            )

    def advance(self, succeeded: int, failed: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix(done=succeeded, failed=failed, refresh=False)
            self.bar.update(1)

    def write(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            click.echo(line, err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
