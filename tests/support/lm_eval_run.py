"""Run lm-evaluation-harness's `local-completions` on tests/data/lm_eval's task, offline, and
print every (context, continuation, ll, is_greedy) it scored as one JSON list.

    python tests/support/lm_eval_run.py BASE_URL MODEL TOKENIZER_FOLDER

A separate process, as an evaluation would be: lm-eval and its dependencies stay out of
the test process, and its Hugging Face caches go to a temporary folder.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"


def main(base_url: str, model: str, tokenizer: str) -> None:
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as home:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=home,
                          HF_DATASETS_CACHE=f"{home}/datasets", TOKENIZERS_PARALLELISM="false")
        import lm_eval
        from lm_eval.tasks import TaskManager

        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": model, "base_url": f"{base_url}/v1/completions", "tokenizer": tokenizer,
                "tokenizer_backend": "huggingface", "add_bos_token": True, "max_retries": 1, "num_concurrent": 2,
            },
            tasks=["tiny_mc"],
            task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            log_samples=True,
        )
    scored = [
        {"context": args[0], "continuation": args[1], "ll": response[0], "is_greedy": response[1]}
        for sample in results["samples"]["tiny_mc"]
        for args, response in zip(sample["arguments"], sample["filtered_resps"])
    ]
    json.dump({"scored": scored, "acc": results["results"]["tiny_mc"]["acc,none"]}, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:4])
