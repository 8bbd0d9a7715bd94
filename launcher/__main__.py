"""`python -m meshrun.launcher RUN_DIR`: run this rank of the job whose spec.json is in RUN_DIR."""

from __future__ import annotations

import sys
from pathlib import Path

from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.rank.preempt import EXIT_INPUT

USAGE = "usage: python -m meshrun.launcher RUN_DIR"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    from meshrun.launcher.contract.records.rundir import record_exit
    from meshrun.launcher.rank.entry import run_rank

    try:
        return run_rank(argv[1])
    except SchemaError as exc:
        # User errors (a bad spec, a missing data file: each named where it is read): one line that says the
        # fix, no traceback. A file that vanishes while the job runs is not one: it fails (exit 1) with its
        # traceback, and rank-error.txt says what vanished (meshrun.launcher.rank.failure).
        print(f"meshrun launcher: error: {exc}", file=sys.stderr, flush=True)
        try:  # any rank: the others may be killed (kill-on-bad-exit) before rank 0 could say it
            record_exit(Path(argv[1]), EXIT_INPUT)
        except OSError:
            pass  # no run dir to write to: srun's own status stands
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv))
