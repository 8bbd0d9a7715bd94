#!/usr/bin/env bash
# README's first command: set up, build the corpus, and train the example 3D layout
# (examples/gpt-3d.yaml: pp 2 x dp 2 x tp 2 = 8 CPU ranks) on the `local` cluster.
# Extra arguments go to `meshrun submit`, e.g. --set parallel.pp_schedule=gpipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/meshrun data
echo "the example's 8 ranks start (each imports torch and builds its stage: up to a minute) before the first step" >&2
exec .venv/bin/meshrun submit examples/gpt-3d.yaml -c local --wait "$@"
