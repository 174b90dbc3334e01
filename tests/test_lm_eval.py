"""lm-evaluation-harness against a live gateway: `local-completions` scores a 20-question
multiple-choice task through `/v1/completions` (echo + logprobs), and every log-likelihood
it reports equals the `loglikelihood` tool's for the same context and continuation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_tools import result

ROOT = Path(__file__).parent.parent


@pytest.mark.lm_eval
def test_lm_eval_scores_a_task_with_the_loglikelihood_tools_numbers(server, tiny_model_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "lm_eval_run.py"), server.url, tiny_model_path.name, str(tiny_model_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    scored = out["scored"]
    assert len(scored) == 80  # 20 questions, 4 choices each
    assert 0 <= out["acc"] <= 1
    for start in range(0, len(scored), 20):
        batch = scored[start : start + 20]
        expected = result(server.url, "loglikelihood", {
            "prompts": [s["context"] for s in batch], "continuations": [s["continuation"] for s in batch],
        })
        for s, ll, greedy in zip(batch, expected["ll"], expected["is_greedy"]):
            assert s["ll"] == pytest.approx(ll, abs=1e-4), s
            assert s["is_greedy"] == greedy, s
