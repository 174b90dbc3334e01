"""`streamgate run` streaming text, and `streamgate chat`, as a user sees them: on a terminal and piped.

The CLI runs as a subprocess against the shared in-process gateway on the tiny
model (whose tokenizer has a chat template), on a pseudo-terminal of a set
size or with its output piped. The jobs it starts are recorded on the server,
so each test compares what reached the terminal with the `partial` events the
job sent, in order.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from gateway.cli.views import printable as _printable
from tests.conftest import Server, build_tiny_model, track_jobs
from tests.support.processes import ROOT, STREAMGATE, clean_env, free_port

TIMEOUT = 120
BAR_CONTROLS = re.compile(r"[\r\x1b]")  # what a redrawn bar leaves: carriage returns, escape sequences


def env() -> dict[str, str]:
    # Without COLUMNS or LINES, the terminal's size is the pty's own.
    return {k: v for k, v in clean_env().items() if k not in ("COLUMNS", "LINES")}


class Terminal:
    """A command on a pseudo-terminal of `cols` × `rows` (stdin, stdout and stderr): all it writes, in order."""

    def __init__(self, args: list[str], cols: int = 80, rows: int = 24, stdout: Any = None) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(
            [str(STREAMGATE), *args], stdin=slave, stdout=stdout or slave, stderr=slave, cwd=ROOT, env=env(),
            start_new_session=True,
        )
        os.close(slave)
        self.raw = b""

    @property
    def text(self) -> str:
        """The output decoded, with the terminal's line ends ("\\r\\n") back to "\\n"."""
        return self.raw.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def read_until(self, predicate: Callable[[str], bool], timeout: float = TIMEOUT) -> str:
        """Read until `predicate(self.text)` holds (checked at least every 0.1 s: it may watch the server too)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; the terminal shows:\n{self.text}")
            if self._read(0.1) is False:
                raise AssertionError(f"the command ended; the terminal shows:\n{self.text}")
        return self.text

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float = TIMEOUT) -> int:
        """Read to the end of the output; the exit code."""
        deadline = time.monotonic() + timeout
        try:
            while self._read(0.1) is not False:
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError(f"the command did not end; the terminal shows:\n{self.text}")
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            os.close(self.master)

    def _read(self, timeout: float) -> bool | None:
        """Take what is there within `timeout`: True if something, None if nothing yet, False at the end."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return None
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every end of the terminal's other side is closed
            return False
        self.raw += data
        return bool(data)


def piped(*args: str, stdin: str | None = None, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STREAMGATE), *args], cwd=ROOT, env={**env(), **(extra_env or {})}, input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT,
    )


def partial_texts(job: Any) -> dict[int, list[str]]:
    """The text of each `partial` event a job sent, by index, in order."""
    texts: dict[int, list[str]] = {}
    for event in job.events:
        if event.type == "partial":
            data = json.loads(event.data)
            texts.setdefault(data["index"], []).append(data["text"])
    return texts


def result_of(job: Any) -> Any:
    assert job.terminal is not None and job.terminal.type == "data", job.terminal
    return json.loads(job.terminal.data)


def shown_in_order(output: str, pieces: list[str], start: int = 0) -> tuple[int, int]:
    """Where `pieces` (as a terminal shows them) sit in `output`, one right after the other: (first, end)."""
    shown = "".join(_printable(piece) for piece in pieces)
    at = output.find(shown, start)
    assert at >= 0, f"not shown in one run:\n{shown!r}\nin:\n{output!r}"
    return at, at + len(shown)


@pytest.fixture
def jobs(server: Server) -> dict[str, Any]:
    return track_jobs(server)


def only_job(jobs: dict[str, Any]) -> Any:
    assert len(jobs) == 1, list(jobs)
    return next(iter(jobs.values()))


# -- run: one text, streamed as it comes ---------------------------------------------


def test_run_streams_each_token_to_the_terminal_before_the_result(server, jobs):
    term = Terminal(["run", "generate", "prompts=Hello", "max_tokens=12", "--url", server.url], cols=60)
    assert term.wait() == 0, term.text
    job = only_job(jobs)
    texts = partial_texts(job)
    assert set(texts) == {0} and len(texts[0]) >= 2
    assert "".join(texts[0]) == result_of(job)["completions"][0]
    output = term.text
    result_at = output.rindex('{\n  "completions"')
    assert json.loads(output[result_at:]) == result_of(job)
    # Every token's text, in order, in one run: no bar drawn into it, all of it before the result.
    first, end = shown_in_order(output, texts[0], output.index("RUNNING\n"))
    assert end < result_at
    assert not BAR_CONTROLS.search(output[first:end])
    assert output[end:result_at] in ("\n", "")  # the line ended, unless the text ended it


def test_run_streams_text_piped_without_a_bar(server, jobs):
    proc = piped("run", "generate", "prompts=Hello", "max_tokens=12", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    job = only_job(jobs)
    assert json.loads(proc.stdout) == result_of(job)
    first, end = shown_in_order(proc.stderr, partial_texts(job)[0])
    assert proc.stderr.startswith("RECEIVED\n") and proc.stderr[:first].endswith("RUNNING\n")
    assert proc.stderr[end:] == "\n"
    assert not BAR_CONTROLS.search(proc.stderr)


def test_generated_control_characters_are_shown_not_run(server, jobs):
    # The tiny model's bytes are arbitrary: whatever it sends, the terminal gets no control character but newlines.
    proc = piped("run", "generate", "prompts=Hello", "prompts=\x1b[2J", "max_tokens=40", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", proc.stderr)
    assert _printable("a\x1b[2J\r\tb\n\x7f\x9b") == "a␛[2J␍\tb\n␡\ufffd"


# -- run: several texts, labelled line by line ---------------------------------------------


def labelled_lines(completions: list[str]) -> list[str]:
    """Each completion's lines as `run` shows several texts: `[index] line`, none empty at the end."""
    lines = []
    for index, completion in enumerate(completions):
        pieces = _printable(completion).split("\n")
        lines += [f"[{index}] {piece}" if piece else f"[{index}]" for piece in pieces[:-1]]
        lines += [f"[{index}] {pieces[-1]}"] if pieces[-1] else []
    return lines


def test_several_prompts_are_shown_line_by_line_with_their_index(server, jobs):
    proc = piped("run", "generate", "prompts=Hello", "prompts=Hi there", "max_tokens=10", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    job = only_job(jobs)
    completions = result_of(job)["completions"]
    assert set(partial_texts(job)) == {0, 1}
    shown = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert sorted(shown) == sorted(labelled_lines(completions))
    # Each completion's own lines keep their order.
    for index in (0, 1):
        mine = [line for line in shown if line.startswith(f"[{index}] ")]
        assert mine == [line for line in labelled_lines(completions) if line.startswith(f"[{index}] ")]
    assert not BAR_CONTROLS.search(proc.stderr)


def test_several_prompts_on_a_terminal_print_whole_lines_before_the_result(server, jobs):
    term = Terminal(["run", "generate", "prompts=Hello", "prompts=Hi there", "max_tokens=10", "--url", server.url],
                    cols=200)
    assert term.wait() == 0, term.text
    completions = result_of(only_job(jobs))["completions"]
    output = term.text
    result_at = output.rindex('{\n  "completions"')
    for line in labelled_lines(completions):
        assert output.find(line + "\n") in range(0, result_at), (line, output)


def test_the_width_is_the_terminal_of_stderr_with_the_result_in_a_file(server, jobs, tmp_path: Path):
    with (tmp_path / "result.json").open("w") as result_file:
        term = Terminal(["run", "generate", "prompts=a", "prompts=b", "max_tokens=60", "--url", server.url],
                        cols=40, stdout=result_file)
        assert term.wait() == 0, term.text
    assert json.loads((tmp_path / "result.json").read_text()) == result_of(only_job(jobs))
    shown = [line.rsplit("\r", 1)[-1] for line in term.text.splitlines() if "[0] " in line or "[1] " in line]
    assert len(shown) >= 4 and all(len(line) <= 40 for line in shown), shown


def test_long_text_of_several_prompts_is_wrapped_at_the_terminal_width(server, jobs):
    proc = piped("run", "generate", "prompts=a", "prompts=b", "max_tokens=150", "--url", server.url,
                 extra_env={"COLUMNS": "50"})
    assert proc.returncode == 0, proc.stderr
    completions = result_of(only_job(jobs))["completions"]
    shown = [line for line in proc.stderr.splitlines() if line[:4] in ("[0] ", "[1] ")]
    assert shown and all(len(line) <= 50 for line in shown)
    for index, completion in enumerate(completions):
        # Wrapped lines put back together give the completion, less the spaces at the breaks.
        joined = "".join(line[4:] for line in shown if line.startswith(f"[{index}] "))
        assert joined.replace(" ", "") == _printable(completion).replace("\n", "").replace(" ", "")


# -- the client token ------------------------------------------------------------------------


def test_token_from_the_flag_or_the_environment(serve):
    secured = serve(tokens=["alice=s3cret-token-of-alice"])
    refused = piped("run", "predict", "prompt=Hi", "top_k=2", "--url", secured.url)
    assert refused.returncode == 2 and "401 unauthorized" in refused.stderr
    by_flag = piped("run", "predict", "prompt=Hi", "top_k=2", "--url", secured.url, "--token", "s3cret-token-of-alice")
    assert by_flag.returncode == 0, by_flag.stderr
    assert len(json.loads(by_flag.stdout)["predictions"]) == 2
    by_env = piped("chat", "Hi", "--max-tokens", "2", "--url", secured.url,
                   extra_env={"STREAMGATE_TOKEN": "s3cret-token-of-alice"})
    assert by_env.returncode == 0, by_env.stderr


# -- chat -------------------------------------------------------------------------------------


def sent(job: Any) -> dict[str, Any]:
    params = msgspec.to_builtins(job.params)
    return {k: v for k, v in params.items() if v is not None}


def test_chat_prints_the_reply_on_stdout(server, jobs):
    proc = piped("chat", "Hello", "--max-tokens", "6", "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    job = only_job(jobs)
    assert job.tool == "generate"
    assert sent(job) == {**sent(job), "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    assert "prompts" not in sent(job)
    reply = result_of(job)["completions"][0]
    assert "".join(partial_texts(job)[0]) == reply
    # Piped, the reply is exact (no symbols for control characters): it is the answer.
    assert proc.stdout == reply + "\n"
    assert proc.stderr == "(the reply reached --max-tokens 6)\n"


def test_chat_options_reach_the_job(server, jobs):
    args = ["chat", "Hi", "--system", "Be brief.", "--max-tokens", "5", "--temperature", "1.5", "--seed", "7",
            "--url", server.url]
    first, again = piped(*args), piped(*args)
    assert first.returncode == 0 and again.returncode == 0, first.stderr
    assert first.stdout == again.stdout  # the same seed
    params = sent(next(iter(jobs.values())))
    assert params["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (params["max_tokens"], params["temperature"], params["seed"]) == (5, 1.5, 7)


def test_chat_reads_the_message_from_piped_stdin(server, jobs):
    proc = piped("chat", "--max-tokens", "3", "--url", server.url, stdin="What now?\n")
    assert proc.returncode == 0, proc.stderr
    assert sent(only_job(jobs))["messages"] == [{"role": "user", "content": "What now?"}]
    empty = piped("chat", "--url", server.url, stdin="  \n")
    assert empty.returncode == 2 and "no message" in empty.stderr


def test_chat_streams_the_reply_to_the_terminal(server, jobs):
    term = Terminal(["chat", "Hello", "--max-tokens", "12", "--url", server.url], cols=60)
    assert term.wait() == 0, term.text
    job = only_job(jobs)
    output = term.text
    first, end = shown_in_order(output, partial_texts(job)[0])
    assert first == 0 and output[end:] == "\n(the reply reached --max-tokens 12)\n"


def test_chat_on_a_terminal_keeps_the_conversation(server, jobs):
    term = Terminal(["chat", "--system", "Be kind.", "--max-tokens", "4", "--url", server.url])
    term.read_until(lambda text: text.endswith("> "))
    term.write(b"Hi\n")
    term.read_until(lambda text: len(jobs) == 1 and jobs_done(jobs) and text.endswith("> "))
    term.write(b"And then?\n")
    term.read_until(lambda text: len(jobs) == 2 and jobs_done(jobs) and text.endswith("> "))
    term.write(b"\x04")  # Ctrl-D
    assert term.wait() == 0, term.text
    first, second = jobs.values()
    reply = result_of(first)["completions"][0]
    assert sent(first)["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    assert sent(second)["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    output = term.text
    at = output.index("Hi\n")
    _, end = shown_in_order(output, partial_texts(first)[0], at)
    shown_in_order(output, partial_texts(second)[0], output.index("And then?\n", end))


def jobs_done(jobs: dict[str, Any]) -> bool:
    return all(job.terminal is not None for job in jobs.values())


def test_chat_refusals_exit_2_and_an_unreachable_server_3(server):
    # The default --max-tokens (256) does not fit the tiny model's context with the conversation.
    proc = piped("chat", "Hello", "--url", server.url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "413 too_long" in proc.stderr and "(field: messages)" in proc.stderr
    unreachable = f"http://127.0.0.1:{free_port()}"
    proc = piped("chat", "Hello", "--url", unreachable)
    assert proc.returncode == 3 and unreachable in proc.stderr


def test_chat_with_a_model_without_a_chat_template_exits_2(serve, tmp_path: Path):
    plain = serve(model_path=build_tiny_model(tmp_path / "plain", chat=False))
    proc = piped("chat", "Hello", "--max-tokens", "4", "--url", plain.url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "422 unsupported_by_model" in proc.stderr and "(field: messages)" in proc.stderr
    assert "chat template" in proc.stderr
    # Prompts as plain text still run on it.
    assert httpx.post(plain.url + "/generate/run", json={"prompts": ["a"], "max_tokens": 2}, timeout=60).status_code == 200
