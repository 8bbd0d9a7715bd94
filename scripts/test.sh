#!/usr/bin/env bash
# README's second command: set up everything the tests need, then run the whole suite.
# Installs Debian's Slurm, munge, MariaDB and OpenSSH server (root, apt) when missing;
# the tests start and stop their own Slurm cluster and sshd (tests/testbed/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash tests/testbed/install.sh
exec .venv/bin/python -m pytest -q "$@"
