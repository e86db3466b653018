#!/usr/bin/env bash
# A new user's first hour, end to end, from a fresh clone: the README's set-up (`make demo`), then the
# sidecar walkthrough of docs/sidecar.md ("Walkthrough on the bundled tiny target"), line for line,
# then the adoption walkthrough of docs/adoption.md: one checkpoint of each foreign layout (a loop's
# `.pt`, HF `checkpoint-N/`, SpecForge, DeepSpec with a plain-file `step_latest`, speculators,
# Automodel, vLLM's fused layout) through `import` / `watch` / `enqueue --external`, one worker
# publishing to TensorBoard and MLflow, and both read back against the ledger. Prints each step's
# wall time and the total.
#
#   bench/newcomer.sh [WORKDIR]           # default: a new /tmp/dflash-newcomer.XXXXXX
#   bench/newcomer.sh --quick [WORKDIR]   # the adoption walkthrough alone, on this checkout and its
#                                         # .venv ($PYTHON overrides), with a 10-step drafter (~5-10 min)
#
# Uses only the committed tree (it clones this repository's HEAD; --quick: this checkout as it is)
# and a private $DFLASH_HOME under WORKDIR, so nothing in ~/.cache or a running Redis is touched;
# W&B stays offline. Needs python3.11 (or python3 >= 3.11), git, make, and the package index pip is
# configured with (the full run adds the `trackers` extra, TensorBoard and MLflow, for the last part).
set -euo pipefail

QUICK=0
if [[ ${1:-} == --quick ]]; then QUICK=1; shift; fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/dflash-newcomer.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
CLONE=$WORK/clone
export DFLASH_HOME=$WORK/home           # the embedded Redis, ledger, caches of the walkthrough
export WANDB_MODE=offline WANDB_SILENT=true
unset REDIS_URL DFLASH_CHECKPOINT_ROOTS DFLASH_TARGET DFLASH_RESULTS_DIR DFLASH_WANDB_DIR WANDB_DIR VIRTUAL_ENV
unset DFLASH_TENSORBOARD_DIR DFLASH_MLFLOW_TRACKING_URI MLFLOW_TRACKING_URI DFLASH_SINKS

T0=$(date +%s)
step() { STEP_T=$(date +%s); echo; echo "== $(date -u +%H:%M:%S) $*"; }
took() { echo "   ($(( $(date +%s) - STEP_T )) s)"; }

# ---- docs/adoption.md: trainers' own layouts, as they write them; TensorBoard and MLflow read back
# ZDIR: a drafter in z-lab's layout (config.json + model.safetensors), the weights every layout carries
adoption() {
    local ZDIR=$1 TINY=$PWD/dflash_train/assets/tiny_target A=$WORK/adoption
    export DFLASH_CHECKPOINT_ROOTS=$A/ckpts   # ROOT: the converted checkpoints; the trainers' files lie outside it
    mkdir -p $A/ckpts

    step "adoption: write one checkpoint of each trainer's layout (from $ZDIR)"
    python - "$ZDIR" "$TINY" "$A" <<'EOF'
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_train.core.target import Target
from tests.support import layouts  # the layouts the adoption tests write, from each trainer's code

z, tiny, a = map(Path, sys.argv[1:4])
sd, target = load_file(str(z / "model.safetensors")), Target.load(tiny)
state = {"model_state_dict": sd, "optimizer_state_dict": {"state": {}}}
for d in ("loop-hand", "loop-run", "hf-out/checkpoint-40", "sf-out/sfrun-step300"):
    (a / d).mkdir(parents=True)
torch.save({**state, "step": 1000}, a / "loop-hand" / "checkpoint_step1k.pt")        # a loop's file, by hand
torch.save({**state, "step": 20000}, a / "loop-run" / "checkpoint_step20k.pt")       # a loop's file, watched
save_file({f"model.{k}": v for k, v in sd.items()}, str(a / "hf-out/checkpoint-40/model.safetensors"))
(a / "hf-out/checkpoint-40/trainer_state.json").write_text(json.dumps({"global_step": 40}))
torch.save({"model": {f"draft_model.{k}": v for k, v in sd.items()}, "optimizer": {}, "global_step": 300},
           a / "sf-out/sfrun-step300/training_state.pt")
layouts.deepspec(z, a / "exp1" / "step_150", target)
(a / "exp1" / "step_latest").write_text("step_150\n")  # DeepSpec's marker written as a plain file
layouts.speculators(z, a / "spec-save" / "300", target)
layouts.automodel(z, a / "automodel-drafter", target)
layouts.vllm(z, a / "vllm-drafter", target)
print("\n".join(sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())))
EOF
    took

    step "adoption: a loop's file by hand (import, then enqueue the record)"
    dflash-eval import $A/loop-hand/checkpoint_step1k.pt --config $ZDIR/config.json
    dflash-eval enqueue $A/ckpts/loop-hand/step-00001000 --target $TINY
    took
    step "adoption: watch a loop's directory (.pt with a step entry)"
    dflash-eval watch $A/loop-run --config $ZDIR/config.json --target $TINY --once --settle 0
    took
    step "adoption: watch a Hugging Face Trainer output (checkpoint-N/)"
    dflash-eval watch $A/hf-out --config $ZDIR/config.json --target $TINY --once --settle 0
    took
    step "adoption: watch a SpecForge output ({run}-step{N}/training_state.pt)"
    dflash-eval watch $A/sf-out --config $ZDIR/config.json --target $TINY --once --settle 0
    took
    step "adoption: watch a DeepSpec experiment (step_N/, step_latest a plain file)"
    dflash-eval watch $A/exp1 --target $TINY --once --settle 0
    took
    step "adoption: watch a speculators save dir (<N>/)"
    dflash-eval watch $A/spec-save --target $TINY --once --settle 0
    took
    step "adoption: NeMo Automodel and vLLM's fused layout (enqueue --external)"
    dflash-eval enqueue --external $A/automodel-drafter --target $TINY
    dflash-eval enqueue --external $A/vllm-drafter --target $TINY
    took

    step "adoption: one worker, published to TensorBoard and MLflow"
    dflash-eval worker --burst --target $TINY --sink tensorboard,mlflow
    dflash-eval results --run loop-hand --run loop-run --run hf-out --run sf-out --run exp1 --run spec-save \
        --run automodel-drafter --run vllm-drafter
    took

    step "adoption: TensorBoard and MLflow read back against the ledger"
    python - <<'EOF'
import os
from pathlib import Path

from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eval_worker.results.ledger import Ledger

home = Path(os.environ["DFLASH_HOME"])
ledger = {}
for rec in Ledger(home / "results").records():
    ledger[(rec["run_id"], rec["step"])] = rec["result"]["tau"]["macro"]
tb = {}
for d in sorted({p.parent for p in (home / "tensorboard").rglob("events.out.tfevents.*")}):
    acc = EventAccumulator(str(d)).Reload()
    for e in (acc.Scalars("eval/tau") if "eval/tau" in acc.Tags()["scalars"] else []):
        tb[(d.relative_to(home / "tensorboard").parts[0], e.step)] = e.value
client = MlflowClient(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
ml, states = {}, {}
for exp in client.search_experiments():
    for run in client.search_runs([exp.experiment_id]):
        name = run.data.tags.get("mlflow.runName", run.info.run_id)
        states[name] = run.info.status
        for m in client.get_metric_history(run.info.run_id, "eval/tau"):
            ml[(name, m.step)] = m.value
print(f"{'run':20s} {'step':>6s} {'ledger tau':>11s} {'TensorBoard':>11s} {'MLflow':>8s}")
bad = 0
for (run, step), tau in sorted(ledger.items()):
    t = next((v for (r, s), v in tb.items() if s == step and r.startswith(run)), None)
    m = next((v for (r, s), v in ml.items() if s == step and r.startswith(run)), None)
    ok = t is not None and m is not None and abs(t - tau) < 1e-4 and abs(m - tau) < 1e-4
    bad += not ok
    print(f"{run:20s} {step:6d} {tau:11.4f} {t if t is None else f'{t:.4f}':>11} "
          f"{m if m is None else f'{m:.4f}':>8} {'' if ok else 'MISMATCH'}")
print("MLflow runs: " + ", ".join(f"{n} {s}" for n, s in sorted(states.items())))
raise SystemExit(1 if bad else 0)
EOF
    took
}

if [[ $QUICK == 1 ]]; then
    # this checkout and its venv, as they are: `dflash-eval` / `dflash-train` / `python` from it
    PY=${PYTHON:-$REPO/.venv/bin/python}
    cd "$REPO"
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    dflash-eval() { "$PY" -m eval_worker.cli "$@"; }
    dflash-train() { "$PY" -m dflash_train.training.cli "$@"; }
    python() { "$PY" "$@"; }
    step "quick: a drafter trained elsewhere (10 steps, 8 prompts)"
    dflash-train --config demo --max-steps 10 --publish-every 10 --num-prompts 8 --run-id elsewhere \
        --checkpoint-root $WORK/elsewhere
    mkdir -p $WORK/hub/tiny-drafter-10steps
    cp $WORK/elsewhere/elsewhere/step-00000010/{config.json,model.safetensors} $WORK/hub/tiny-drafter-10steps/
    took
    adoption $WORK/hub/tiny-drafter-10steps
    step "clean up: the embedded Redis the walkthrough started"
    dflash-eval redis stop
    took
    echo
    echo "newcomer --quick: total wall time $(( $(date +%s) - T0 )) s on $(nproc) core(s), load $(cut -d' ' -f1-3 /proc/loadavg)"
    exit 0
fi

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

step "install the trackers extra (TensorBoard, MLflow: README, \"TensorBoard and MLflow\")"
pip install -q -e '.[trackers]'
took
PYTHONPATH=$PWD adoption $W/hub/tiny-DFlash-b16

step "clean up: the embedded Redis the walkthrough started"
dflash-eval redis stop
chmod -R u+w $W/hub
took

echo
echo "newcomer: total wall time $(( $(date +%s) - T0 )) s on $(nproc) core(s), load $(cut -d' ' -f1-3 /proc/loadavg)"
