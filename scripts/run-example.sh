#!/usr/bin/env bash
# README's first command: set up, build the corpus, and train the example job on the `local` cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/meshrun data
exec .venv/bin/meshrun submit examples/tiny.yaml -c local --wait "$@"
