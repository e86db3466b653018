#!/usr/bin/env bash
# The device check a lent GPU machine runs unattended (an H200: every part bounded, 470 s at most),
# from a bare machine whose image has Python 3.12, torch, transformers, accelerate, safetensors, tokenizers,
# numpy, xxhash, filelock, psutil, fsspec, pyyaml, pytest, hypothesis and tensorboard, and no registry.
#
# The rest travels as wheels: bench/gpu_wheels.txt names them (pydantic, pydantic-core, annotated-types,
# typing-inspection, redis, rq, croniter, python-dateutil, six). Before the device run, here:
#     bench/gpu_wheels.sh              # pip download --no-deps --only-binary=:all: --python-version 3.12
#                                      #   --platform manylinux2014_x86_64 ... into .whl/ (git-ignored)
# then run it with `.whl` carried:  bench/gpu_check.sh   (it does `pip install --no-index --no-deps
# --target "$OUT/gpu_check/deps" .whl/*.whl` and puts that folder and the repository on PYTHONPATH).
#
# Parts (each its own process under `timeout`; its log under $OUT/gpu_check/ as it runs, via tee):
#   tests    pytest -m gpu tests/unit/training/test_gpu.py (flex at head_dim 16, the SDPA fallback at 8)
#   smoke    flex vs SDPA losses on the bundled tiny target; trainer queue depth 0 vs 2 throughput
#   trainer  a Qwen3-8B-shaped target (bf16, random weights), 1-layer drafter: tok/s and peak memory, flex and SDPA
#   engine   the same target: HF generate ms/token at batch 1 and 8; the engine (Evaluator.evaluate) on
#            8 prompts x 256 tokens: cold phases, reference ms/token, warm per checkpoint, walk vs all vs auto
# Failed parts' logs are printed in full at the end, then ONE table (bench/gpu_check.py table).
#
# Usage: bench/gpu_check.sh [--dry-run] [--parts tests,smoke,trainer,engine] [--out DIR]
#   --dry-run   the same parts on the CPU at tiny shapes, packages the device image lacks hidden
#               (tests/integration/test_gpu_check.py runs it)
#   --out DIR   where logs and results go (default: $OUT/gpu_check, else a new temporary folder)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
DRY=0
PARTS=tests,smoke,trainer,engine
DIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --parts) PARTS=$2; shift ;;
        --out) DIR=$2; shift ;;
        *) echo "usage: bench/gpu_check.sh [--dry-run] [--parts tests,smoke,trainer,engine] [--out DIR]" >&2
           exit 2 ;;
    esac
    shift
done
if [ -z "$DIR" ]; then
    if [ -n "${OUT:-}" ]; then DIR="$OUT/gpu_check"; else DIR=$(mktemp -d /tmp/gpu_check.XXXXXX); fi
fi
mkdir -p "$DIR"
RESULTS="$DIR/results.jsonl"
: > "$RESULTS"
rm -f "$DIR"/{setup,tests,smoke,trainer,engine,dry,device}.log "$DIR/table.md"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# seconds per part: their sum (470) keeps the whole run under 8 minutes on the device
declare -A LIMIT=([setup]=20 [tests]=85 [smoke]=85 [trainer]=80 [engine]=200 [dry]=300)
declare -A STATUS=()
FAILED=()
T0=$(date +%s)
echo "gpu_check: $(date -u +%FT%TZ) dry_run=$DRY parts=$PARTS logs=$DIR"

# run NAME COMMAND...: under `timeout`, output to the terminal and to $DIR/NAME.log as it goes
run() {
    local name=$1; shift
    local t=$(date +%s)
    echo "== $name (limit ${LIMIT[$name]}s): $*"
    timeout --kill-after=10 "${LIMIT[$name]}" "$@" 2>&1 | tee "$DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t ))
    if [ "$rc" = 0 ]; then STATUS[$name]="ok (${took}s)"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then STATUS[$name]="TIMEOUT after ${took}s (partial results kept)"; FAILED+=("$name")
    else STATUS[$name]="FAILED rc=$rc (${took}s)"; FAILED+=("$name"); fi
    echo "== $name: ${STATUS[$name]}"
}

# the carried wheels, where the image lacks them
if [ "$DRY" = 0 ] && ! "$PY" -c "import pydantic, redis, rq, croniter" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        run setup "$PY" -m pip install --quiet --no-index --no-deps --target "$DIR/deps" .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$DIR/deps"
    else
        echo "gpu_check: pydantic/redis/rq/croniter missing and no .whl/: run bench/gpu_wheels.sh first" >&2
        STATUS[setup]="FAILED: no .whl/"; FAILED+=(setup)
    fi
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 | tee "$DIR/device.log"

PY_PARTS=()
for part in ${PARTS//,/ }; do
    case "$part" in
        tests)
            if [ "$DRY" = 1 ]; then  # no CUDA: every test would skip; the default suite collects the file anyway
                STATUS[tests]="skipped (dry run)"
            else
                run tests "$PY" -m pytest -p no:cacheprovider -q -rfEs --tb=long -m gpu -o addopts= \
                    tests/unit/training/test_gpu.py
            fi ;;
        smoke|trainer|engine) PY_PARTS+=("$part") ;;
        *) echo "gpu_check: unknown part $part" >&2; exit 2 ;;
    esac
done
if [ "$DRY" = 1 ] && [ ${#PY_PARTS[@]} -gt 0 ]; then
    # one process for the parts: the dry run checks the code at tiny shapes, and pays torch's import once
    joined=$(IFS=,; echo "${PY_PARTS[*]}")
    run dry "$PY" bench/gpu_check.py "$joined" --results "$RESULTS" --dry-run
else
    for part in "${PY_PARTS[@]}"; do
        run "$part" "$PY" bench/gpu_check.py "$part" --results "$RESULTS"
    done
fi

for name in "${FAILED[@]}"; do
    if [ -f "$DIR/$name.log" ]; then
        echo; echo "=================== FAILED PART: $name (full log, $DIR/$name.log) ==================="
        cat "$DIR/$name.log"
    fi
done

ARGS=()
for name in setup tests smoke trainer engine dry; do
    [ -n "${STATUS[$name]:-}" ] || continue
    s=${STATUS[$name]}
    if [ "$name" = tests ] && [ -f "$DIR/tests.log" ]; then  # pytest's summary line
        s="$s: $(grep -E '(passed|failed|skipped|error)' "$DIR/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//')"
    fi
    ARGS+=(--status "$name=$s")
done
echo
echo "gpu_check: $(( $(date +%s) - T0 ))s in all; logs and results.jsonl in $DIR"
"$PY" bench/gpu_check.py table --results "$RESULTS" "${ARGS[@]}" | tee "$DIR/table.md"
rc=${PIPESTATUS[0]}
[ ${#FAILED[@]} = 0 ] && [ "$rc" = 0 ]
