"""The TypeScript client and the dashboard on a model served by vLLM: web/test/inference-server.check.ts,
run by node against the suite's vLLM gateway (`smol` on the vLLM server it started). The client streams
`generate` on it to the server's own greedy answer, cancels a job by aborting, resumes a cut stream, and
gets the typed 422 for a tool the model cannot run; the dashboard, in headless Chromium, lists the
model's tools and the ones it cannot run, and shows a run's completion as the gateway recorded it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.processes import ServeProcess

pytestmark = pytest.mark.vllm

WEB = Path(__file__).resolve().parent.parent / "web"


def test_the_typescript_client_and_the_dashboard_work_on_a_vllm_model(vllm_gateway: ServeProcess) -> None:
    env = {**os.environ, "STREAMGATE_GATEWAY_URL": vllm_gateway.url, "STREAMGATE_MODEL": "smol"}
    done = subprocess.run(
        ["node", "--import", "tsx", "--test", "--test-reporter", "spec", "test/inference-server.check.ts"],
        cwd=WEB, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )
    assert done.returncode == 0, f"node's tests failed ({done.returncode}):\n{done.stdout[-8000:]}"
