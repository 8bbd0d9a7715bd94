#!/usr/bin/env bash
# The GPU checks in one go, for a machine with NVIDIA GPUs; prints one table.
#
#   bash bench/gpu.sh            # from anywhere; uses $PYTHON, else the repo's .venv, else python3
#   GPU_SH_LOGS=DIR bash bench/gpu.sh   # keep every step's full output in DIR (default: a temp dir)
#
# Runs: pytest -q tests/gpu (mixed-precision training on one GPU; `meshrun doctor`'s checks on every
# local GPU: `pytest -s tests/gpu/test_doctor_gpu.py` prints its figures); bench/gpu_train.py (a ~1B GPT through
# the trainer: ms/step, tokens/s, MFU); bench/gpu_ops.py all (NVML read per GPU, bf16 GEMM TFLOP/s, NCCL
# all-reduce bus bandwidth across the local GPUs); bench/gpu_plan.py (the planner with datasheet figures, doctor's
# calibration, the calibrated plan, then the same ~1B job submitted on a profile of this machine: its step time and
# memory against the plan, and status's GPU-hours, NVML energy and cost). Each step has a time limit, so a hang shows as a
# failed row instead of a stuck script. Exits 0 only if every step passed. Without a CUDA GPU it stops
# at once with one line (the CPU checks of the same code are `bench/gpu_train.py --quick` and
# `bench/gpu_ops.py all --quick`, which tests/integration/test_bench_quick.py runs).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 1
if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi

# Fail fast: one line saying what is missing, before anything slow starts.
if ! why="$("$py" - <<'EOF' 2>&1
import sys
try:
    import torch
except Exception as exc:
    sys.exit(f"cannot import torch ({exc})")
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU-only build")
if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU")
EOF
)"; then
  echo "bench/gpu.sh: no usable GPU: ${why##*$'\n'} (python: $py); run it on a GPU machine" >&2
  exit 1
fi

logs="${GPU_SH_LOGS:-$(mktemp -d)}"
mkdir -p "$logs"
rows="$logs/rows.tsv"
machine="$("$py" -c 'import torch; print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")')"
printf 'machine\t%s\tok\n' "$machine" >"$rows"
failed=0

last_line() { grep -v '^[[:space:]]*$' "$1" | tail -n 1; }

# step NAME LIMIT_S CMD...: run CMD with its output in $logs/NAME.log; a failure becomes a row.
step() {
  local name="$1" limit="$2"; shift 2
  echo "== $name: $*" >&2
  local began=$SECONDS
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code after $((SECONDS - began)) s" >&2
  if ((code != 0)); then
    failed=1
    [[ $code == 124 ]] && code="124: over ${limit} s"
    printf '%s\tFAILED (exit %s; last line: %s)\tFAIL\n' "$name" "$code" "$(last_line "$logs/$name.log")" >>"$rows"
    return 1
  fi
}

if step pytest-gpu 900 "$py" -m pytest -q -s -p no:cacheprovider tests/gpu; then
  printf 'pytest tests/gpu\t%s\tok\n' "$(last_line "$logs/pytest-gpu.log")" >>"$rows"
fi
if step gpu_train 900 "$py" bench/gpu_train.py; then
  line="$(grep '^steps ' "$logs/gpu_train.log" | tail -n 1)"
  printf 'gpu_train ~1B GPT\t%s\tok\n' "$(sed -E 's/^steps [0-9]+-[0-9]+: //' <<<"$line")" >>"$rows"
fi
if step gpu_ops 900 "$py" bench/gpu_ops.py all; then
  grep '^ROW' "$logs/gpu_ops.log" | cut -f2- | sed 's/$/\tok/' >>"$rows"
fi
# Its rows are the journey's steps that passed; a failed one ends it, and step() adds that row.
step gpu_plan 600 "$py" bench/gpu_plan.py
grep '^ROW' "$logs/gpu_plan.log" | cut -f2- | sed 's/$/\tok/' >>"$rows"

echo
printf '%-24s %-6s %s\n' "check" "status" "result"
printf '%-24s %-6s %s\n' "-----" "------" "------"
while IFS=$'\t' read -r check value status; do
  printf '%-24s %-6s %s\n' "$check" "$status" "$value"
done <"$rows"
echo "(full output of every step: $logs)"
exit "$failed"
