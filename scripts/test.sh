#!/usr/bin/env bash
# README's second command: set up everything the tests need, then run the whole suite.
# Installs Debian's Slurm, munge, MariaDB and OpenSSH server (root, apt) when missing;
# the tests start and stop their own Slurm cluster and sshd (tests/testbed/).
# First the linter, the formatter check and the type checker (configured in pyproject.toml):
# a lint or type error fails the run like a failing test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash tests/testbed/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
# --durations: every run ends with its 20 slowest tests (CI time is shared: watch what grows).
exec .venv/bin/python -m pytest -q --durations=20 "$@"
