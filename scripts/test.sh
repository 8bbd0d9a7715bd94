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
# Two workers (pytest-xdist): the tests on the Slurm testbed spend most of their time waiting for the
# scheduler (requeues, polling) while the others compute, so they overlap well on 2 cores. --dist
# loadgroup keeps every testbed test in one worker (tests/integration/conftest.py groups them): one
# testbed per machine, started once. MESHRUN_TEST_WORKERS=0 runs them in this process, one at a time.
workers=${MESHRUN_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=20 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=20 -n "$workers" --dist loadgroup "$@"
