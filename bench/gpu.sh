#!/usr/bin/env bash
# The benchmarks that matter on a GPU, in one run of under 10 minutes, into one report.
#
#   bench/gpu.sh [REPORT_DIR]        (default: $OUT where set, else bench/gpu-report)
#
# Runs on a machine whose python3 has a CUDA build of torch. The project's other
# dependencies come from the virtual environment .venv if there is one, else
# they are installed into a throwaway one over python3's packages: from the
# wheels in .whl/ where that folder exists (a machine without the internet:
# `pip download` them here, see bench/README.md), else from the package index.
# The model is random, of SmolLM2-135M's shape (bench/cost.py --shape smollm2),
# with SmolLM2's tokenizer when $SMOLLM2_TOKENIZER or .gpu/smollm2-tokenizer names
# a folder holding it, else reading text byte by byte; nothing is downloaded.
#
# Each benchmark has a time limit, and the report says which ones ran out.
# GPU_BENCH_DEVICE=cpu GPU_BENCH_QUICK=1 runs the same steps on the CPU, each
# benchmark's --quick: a check of this script, not a measurement.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
report_dir=${1:-${OUT:-bench/gpu-report}}
mkdir -p "$report_dir"
report="$report_dir/report.txt"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { printf '%s\n' "$*" | tee -a "$report"; }
: >"$report"

say "# streamgate GPU benchmarks, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi -L 2>&1 | tee -a "$report"

# -- the environment ------------------------------------------------------------
device=${GPU_BENCH_DEVICE:-cuda}
quick=${GPU_BENCH_QUICK:+--quick}
if [ -x .venv/bin/python ] && { [ "$device" = cpu ] || .venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; }; then
    py=.venv/bin/python
else
    env="$work/venv"
    python3 -m venv --system-site-packages "$env"
    # python3 may itself be a virtual environment's (its torch is not the base interpreter's):
    # its site folders are added to the new one's path, after the new one's own.
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/outer.pth"
    if [ -d .whl ]; then
        "$env/bin/pip" install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
        "$env/bin/pip" install -q --no-index --no-deps --no-build-isolation --no-compile -e . || exit 1
    else
        # torch is python3's own (a CUDA build): the project's CPU pin is not installed over it.
        "$env/bin/pip" install -q --no-deps -e . || exit 1
        "$env/bin/pip" install -q $("$env/bin/python" - <<'EOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if not d.startswith("torch")))
EOF
) || exit 1
    fi
    py="$env/bin/python"
fi
"$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.device_count()} GPU(s)")' | tee -a "$report"

# -- the models -----------------------------------------------------------------
tokenizer=${SMOLLM2_TOKENIZER:-}
if [ -z "$tokenizer" ] && [ -d .gpu/smollm2-tokenizer ]; then tokenizer=.gpu/smollm2-tokenizer; fi
"$py" bench/cost.py --shape smollm2 --save "$work/smollm2" ${tokenizer:+--tokenizer-from "$tokenizer"} >/dev/null 2>&1 || exit 1
"$py" -c "from pathlib import Path; from tests.support.tiny_models import build_tiny_model; build_tiny_model(Path('$work/tiny'))" || exit 1
say "models: random SmolLM2-135M shape ($([ -n "$tokenizer" ] && echo "SmolLM2's tokenizer" || echo 'byte tokenizer')); tiny random Llama (2 layers, hidden 32)"

# -- the benchmarks ---------------------------------------------------------------
run() {  # run SECONDS NAME ARGS...: one benchmark, its report appended
    local limit=$1 name=$2
    shift 2
    say ""
    say "## $name"
    say "\$ $*"
    local started=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$py" "$@" $quick >>"$report" 2>"$report_dir/$name.err"
    local rc=$?
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && say "(stopped at its limit of ${limit} s)"
    say "(exit $rc after $((SECONDS - started)) s)"
    [ -s "$report_dir/$name.err" ] || rm -f "$report_dir/$name.err"
}

gen=(bench/generation.py --device "$device" --batch-sizes 16,64)
run 120 generation-tiny-process "${gen[@]}" --model "$work/tiny" --engine process
run 100 generation-tiny-thread "${gen[@]}" --model "$work/tiny" --engine thread
run 130 generation-smollm2-process "${gen[@]}" --model "$work/smollm2" --tokens 64 --engine process
run 120 tool-speed-smollm2 bench/tool_speed.py --device "$device" --model "$work/smollm2" --rounds 3
run 60 embeddings bench/embeddings.py --device "$device"
# A higher class's wait under a full engine, with cores to spare for the clients (2 are not enough).
run 70 priority bench/priority.py --device "$device" --model "$work/tiny" --seconds 5

say ""
say "## targets"
targets=$(grep -E '^target:' "$report" | sed 's/^/  /')
say "$targets"
echo "report: $report"
