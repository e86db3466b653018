#!/usr/bin/env bash
# Prepare .whl/ (ignored by git) for bench/gpu_check.sh on a lent GPU machine that reaches no registry:
# the packages of bench/gpu_wheels.txt at the versions requirements.lock pins, as binary wheels for
# CPython 3.12 on manylinux x86_64, without their dependencies (the machine's image has the rest).
# Run here, where a registry is reachable; then pass `.whl` in the device run's `carry`.
#   bench/gpu_wheels.sh [DEST]      (DEST default: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DEST"
specs=()
while read -r name; do
    name=${name%%#*}; name=${name//[[:space:]]/}
    [ -n "$name" ] || continue
    pin=$(grep -i -E "^${name}==" requirements.lock | head -1 | cut -d' ' -f1 || true)
    [ -n "$pin" ] || { echo "gpu_wheels: $name is not pinned in requirements.lock" >&2; exit 1; }
    specs+=("$pin")
done < bench/gpu_wheels.txt
echo "gpu_wheels: ${specs[*]} -> $DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" "${specs[@]}"
ls -l "$DEST"
du -sh "$DEST"
