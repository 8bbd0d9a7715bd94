#!/usr/bin/env bash
# Create .venv and install meshrun into it (editable), with the CPU torch wheel pinned, and the
# deepspeed extra with its CPU ops compiled at install time.
# Idempotent: a second run with unchanged requirements takes a fraction of a second.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "setup: meshrun needs Python >= 3.10 (found $("$python" --version 2>&1))" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.meshrun-installed
# This script is in the hash too: a change in how things are installed reinstalls them.
want=$(cat pyproject.toml constraints/cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)
# --no-compile: pip compiles every module it installs to bytecode one at a time (torch's alone: ~13 s of a
# 21 s install here); compile_site does it on every core instead, torch's while pip installs the rest.
# The bytecode matters: CI sets PYTHONDONTWRITEBYTECODE, and without it every Python process the tests start
# would compile torch again.
pip=(.venv/bin/pip install --quiet --disable-pip-version-check --no-compile -c constraints/cpu.txt)
site_packages() { .venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# Compiles what is in the venv's site-packages now. Quiet and never fatal, as pip's own compile: some packages
# ship files that are not meant to compile (templates, Python 2 examples). A file pip replaces while this runs
# is compiled again by the last pass (and Python checks each .pyc against its source anyway).
# Left out, as no process of meshrun or its tests imports them: the packages' own test suites (torch's
# testing/_internal among them) and transformers' models but Llama's (a test-only package: the export tests
# load LlamaForCausalLM through auto/). A module left out that is imported after all compiles as it loads, as
# before. Measured 2026-12-05 on a fresh venv, 2 cores: 27.5 s of CPU instead of 39.7 (15.8 s wall, not 22).
not_imported='/(tests?|testing/_internal)/|/transformers/models/(?!(llama|auto)/)[^/]+/'
compile_site() { .venv/bin/python -m compileall -q -j 0 -x "$not_imported" "$(site_packages)" >/dev/null 2>&1 || true; }

# The CPU ops DeepSpeed would otherwise JIT-compile on first use, into ~/.cache/torch_extensions, on
# every new machine and in every CI run: cpu_adam (optimizer offload, ~60-160 s here) and the shared
# memory collectives every CPU process group loads in init_distributed() (~60 s). Built once here.
ds_ops=(DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu)
# The DeepSpeed wheel with those ops, built once per (DeepSpeed, torch, Python, compiler, CPU: the ops are
# compiled with -march=native) and kept in the user's cache: a second checkout on the same machine (CI's
# clean clone, a git worktree) installs it in seconds instead of compiling for 2.5-5 minutes again.
# Private (0700, ours): pip installs what is there.
wheel_cache=${XDG_CACHE_HOME:-$HOME/.cache}/meshrun/wheels
ds_wheel_key() {
  {
    grep -E '^deepspeed==' constraints/cpu.txt
    .venv/bin/python -c 'import sys, torch; print(sys.version, torch.__version__)'
    c++ --version 2>/dev/null | head -1
    grep -m1 -E '^(flags|Features)' /proc/cpuinfo
    echo "${ds_ops[*]}"
  } | sha256sum | cut -c1-16
}
own_private_dir() {  # $1 made 0700 if new; then it must be ours and writable by no one else
  (umask 077 && mkdir -p "$1") && [ -O "$1" ] && [ -z "$(find "$1" -maxdepth 0 -perm /022)" ]
}
# The wheel's folder in the cache, made private; empty output: the cache is not privately ours.
ds_wheel_dir() {
  local dir
  dir=$wheel_cache/deepspeed-$(ds_wheel_key)
  own_private_dir "$wheel_cache" && own_private_dir "$dir" && echo "$dir"
}
# Builds the wheel into $1 when it is not there: 2.5-5 minutes of compiling on a new machine, run in the
# background while pip installs meshrun's other packages (it needs only torch and the build tools, installed
# first): the two overlap instead of following each other.
build_deepspeed_wheel() {
  local dir=$1 tmp
  tmp=$(mktemp -d "$dir/.build.XXXXXX")
  ticking "building DeepSpeed" env "${ds_ops[@]}" .venv/bin/pip wheel --quiet --disable-pip-version-check \
    -c constraints/cpu.txt --no-build-isolation --no-cache-dir --no-deps -w "$tmp" deepspeed || { rm -rf "$tmp"; return 1; }
  mv "$tmp"/deepspeed-*.whl "$dir"/ && rm -rf "$tmp"
}
# The background build, stopped (its pip and ticker first, then itself) when setup ends before waiting for it.
stop_deepspeed_build() {
  [ -n "${ds_build:-}" ] && kill -0 "$ds_build" 2>/dev/null || return 0
  pkill -TERM -P "$ds_build" 2>/dev/null || true
  kill "$ds_build" 2>/dev/null || true
  echo "setup: stopped the DeepSpeed build in the background" >&2
}
install_deepspeed() {  # $1: the wheel's folder (empty: build straight into the venv, keeping nothing)
  local dir=$1
  if [ -z "$dir" ]; then
    ticking "building DeepSpeed" env "${ds_ops[@]}" "${pip[@]}" --no-build-isolation --no-cache-dir -e '.[dev,deepspeed]'
    return
  fi
  "${pip[@]}" --no-build-isolation "$dir"/deepspeed-*.whl
  "${pip[@]}" --no-build-isolation -e '.[dev,deepspeed]'  # its dependencies; DeepSpeed itself is there
}

ds_ops_installed() {
  DS_ACCELERATOR=cpu .venv/bin/python - >/dev/null 2>&1 <<'PY'
import sys
from deepspeed.git_version_info import installed_ops
sys.exit(not (installed_ops.get("cpu_adam") and installed_ops.get("deepspeed_shm_comm")))
PY
}

say() { echo "setup: $* ($(date +%H:%M:%S))" >&2; }  # pip is --quiet: a line per step says where it is
# A long step says every 30 s that it is still going (pip --quiet prints nothing for minutes while it
# builds DeepSpeed). The ticker sleeps in the background so that it stops at once when the step ends.
ticking() {
  local what=$1 rc=0 ticker; shift
  ( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    s=0
    while :; do
      sleep 30 & nap=$!; wait "$nap"
      s=$((s + 30)); printf 'setup: still %s (%dm%02ds)\n' "$what" $((s / 60)) $((s % 60)) >&2
    done ) &
  ticker=$!
  "$@" || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  return "$rc"
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # constraints/cpu.txt pins the CPU torch wheel; the package itself asks only for a range
  # so that a cluster keeps its CUDA build.
  say "installing meshrun and its packages into .venv (the CPU torch wheel among them: a minute or more)"
  # DeepSpeed builds against the torch here (its setup imports torch): no build isolation, after torch.
  # ninja: the op build uses it (without it, a slow serial compile); py-cpuinfo: the ops' SIMD flags; numpy:
  # torch warns without it.
  # No pip cache: a cached wheel built without the ops would be reused as is.
  # setuptools: the editable install of meshrun and DeepSpeed's build use the venv's (no build isolation, which
  # would set up a build environment of its own for each).
  ticking "installing torch" "${pip[@]}" torch numpy ninja py-cpuinfo 'setuptools>=68'
  compile_site & compiling=$!  # torch's bytecode on the core pip leaves idle
  ds_dir=$(ds_wheel_dir || true)
  ds_build=""
  # A failing step below must not leave the build (or the bytecode pass) running on its own.
  trap 'stop_deepspeed_build; pkill -TERM -P "$compiling" 2>/dev/null || true' EXIT
  if [ -n "$ds_dir" ] && ! ls "$ds_dir"/deepspeed-*.whl >/dev/null 2>&1; then
    say "building DeepSpeed and compiling its CPU ops (several minutes on a new machine; once: kept in $ds_dir)"
    build_deepspeed_wheel "$ds_dir" & ds_build=$!
  elif [ -n "$ds_dir" ]; then
    say "installing DeepSpeed with its CPU ops from $ds_dir"
  fi
  if [ -n "$ds_dir" ] && [ -z "$ds_build" ]; then  # the wheel is there: one pip run installs it and the rest
    ticking "installing packages" "${pip[@]}" --no-build-isolation "$ds_dir"/deepspeed-*.whl -e '.[dev,deepspeed]'
  else
    ticking "installing packages" "${pip[@]}" --no-build-isolation -e '.[dev]'
    if [ -n "$ds_build" ]; then
      wait "$ds_build" || { echo "setup: building DeepSpeed failed (its output is above)" >&2; exit 1; }
    fi
    install_deepspeed "$ds_dir"
  fi
  wait "$compiling" || true
  compile_site  # the packages installed since (torch's files are done: each is only checked)
  if ! ds_ops_installed; then  # a DeepSpeed installed earlier without the ops: rebuild it with them
    ticking "building DeepSpeed's CPU ops" env "${ds_ops[@]}" "${pip[@]}" --no-build-isolation --no-cache-dir --force-reinstall --no-deps deepspeed
    ds_ops_installed || { echo "setup: DeepSpeed's CPU ops did not build (is g++ installed?)" >&2; exit 1; }
    compile_site
  fi
  echo "$want" > "$stamp"
  say "done"
fi
