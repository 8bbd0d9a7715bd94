#!/usr/bin/env bash
# Create .venv and install meshrun into it (editable), with the CPU torch wheel pinned.
# Idempotent: a second run with unchanged requirements takes a fraction of a second.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "setup: meshrun needs Python >= 3.10 (found $("$python" --version 2>&1))" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.meshrun-installed
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # constraints/cpu.txt pins the CPU torch wheel; the package itself asks only for a range
  # so that a cluster keeps its CUDA build.
  .venv/bin/pip install --quiet --disable-pip-version-check -c constraints/cpu.txt -e '.[dev]'
  echo "$want" > "$stamp"
fi
