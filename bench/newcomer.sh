#!/usr/bin/env bash
# A new user's first hour, end to end, from a fresh clone: the README's set-up (`make demo`), then the
# sidecar walkthrough of docs/sidecar.md ("Walkthrough on the bundled tiny target"), line for line,
# with every variable defined here. Prints each step's wall time and the total.
#
#   bench/newcomer.sh [WORKDIR]        # default: a new /tmp/dflash-newcomer.XXXXXX
#
# Uses only the committed tree (it clones this repository's HEAD) and a private $DFLASH_HOME under
# WORKDIR, so nothing in ~/.cache or a running Redis is touched; W&B stays offline. Needs python3.11
# (or python3 >= 3.11), git, make, and the package index pip is configured with.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/dflash-newcomer.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
CLONE=$WORK/clone
export DFLASH_HOME=$WORK/home           # the embedded Redis, ledger, caches of the walkthrough
export WANDB_MODE=offline WANDB_SILENT=true
unset REDIS_URL DFLASH_CHECKPOINT_ROOTS DFLASH_TARGET DFLASH_RESULTS_DIR DFLASH_WANDB_DIR WANDB_DIR VIRTUAL_ENV

T0=$(date +%s)
step() { STEP_T=$(date +%s); echo; echo "== $(date -u +%H:%M:%S) $*"; }
took() { echo "   ($(( $(date +%s) - STEP_T )) s)"; }

step "fresh clone of $(git -C "$REPO" rev-parse --short HEAD) into $CLONE"
git clone -q "$REPO" "$CLONE"
cd "$CLONE"
took

# ---- README "Set-up": make demo (venv, install of the core + demo extra, the demo itself)
step "make demo"
make demo
took

step "after the demo: results / report / status find it without flags; leftover daemons"
.venv/bin/dflash-eval results
.venv/bin/dflash-eval status | tail -n 3
.venv/bin/dflash-eval redis stop --force   # the server `status` started (its first line said so)
took

# ---- docs/sidecar.md walkthrough, with the venv active (exactly its lines)
# shellcheck disable=SC1091
source .venv/bin/activate
step "sidecar walkthrough: someone else's drafter (100 steps), a fresh 300-step run"
W=$PWD/walkthrough TINY=$PWD/dflash_train/assets/tiny_target
export DFLASH_CHECKPOINT_ROOTS=$W/runs:$W/hub
dflash-train --config demo --max-steps 100 --publish-every 100 --num-prompts 128 --run-id elsewhere --checkpoint-root $W/elsewhere
mkdir -p $W/hub/tiny-DFlash-b16
cp $W/elsewhere/elsewhere/step-00000100/{config.json,model.safetensors} $W/hub/tiny-DFlash-b16/ && chmod -R a-w $W/hub
dflash-train --config demo --max-steps 300 --publish-every 100 --num-prompts 128 --run-id fresh --checkpoint-root $W/runs
took

step "sidecar walkthrough: import, enqueue, worker, results"
dflash-eval import $W/hub/tiny-DFlash-b16 --into $W/runs
dflash-eval enqueue $W/runs/tiny-DFlash-b16/step-00000000 --target $TINY
dflash-eval enqueue $W/runs/fresh --baseline $W/runs/tiny-DFlash-b16/step-00000000 --target $TINY
dflash-eval worker --burst --target $TINY
dflash-eval results --run tiny-DFlash-b16 --run fresh
took

step "clean up: the embedded Redis the walkthrough started"
dflash-eval redis stop
chmod -R u+w $W/hub
took

echo
echo "newcomer: total wall time $(( $(date +%s) - T0 )) s on $(nproc) core(s), load $(cut -d' ' -f1-3 /proc/loadavg)"
