"""A rank's fatal error, as one line in the run dir. Torch-free, stdlib only.

Without it, the real reason a job failed (a missing token file, a bad spec.json) sits
inside some rank's log, often under a traceback of the scheduler's own machinery. Each
failing rank writes "rank N: <message>" to `RunDir.rank_error`, first writer wins (the
first failure is the cause; the peers that die after it only echo it), and the local
supervisor and `meshrun status` show that line. Bad input exits EXIT_INPUT (2) with
that one line and no traceback; anything else keeps its traceback in the log. A file
that vanishes while the job runs is not bad input (what the user wrote is checked, and
named, before: SchemaError): it is a failure, and its line says what vanished.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from meshrun.launcher.contract.exitcodes import EXIT_INPUT
from meshrun.launcher.contract.records.ckptdir import CheckpointError
from meshrun.launcher.contract.records.rundir import RunDir, record_exit
from meshrun.launcher.contract.spec.schema import SchemaError

BAD_INPUT: tuple[type[BaseException], ...] = (SchemaError, CheckpointError)
"""What the user fixes, not the cluster: a bad spec, a missing or unusable data file or checkpoint (each
named by a SchemaError where it is read)."""
MAX_CHARS = 1000
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]+")


def vanished(exc: FileNotFoundError) -> str:
    """What a FileNotFoundError during the run means: which file or folder went away under the job."""
    if exc.filename is not None:
        gone = f"{exc.filename}" + (f" (or {exc.filename2})" if exc.filename2 is not None else "")
        return f"{gone} vanished while the job ran ({exc.strerror or exc}); was it removed by hand or by another job?"
    try:
        os.getcwd()
    except FileNotFoundError:
        where = os.environ.get("MESHRUN_CODE_DIR") or os.environ.get("PWD") or "?"
        return f"the working folder {where} vanished while the job ran (a code snapshot removed under it?)"
    return f"a file vanished while the job ran ({exc})"


def one_line(exc: BaseException) -> str:
    """The error as one printable line (the type too, when it is not a bad-input error)."""
    text = _UNPRINTABLE.sub(" ", str(exc)).strip() or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        text = vanished(exc)
    if not isinstance(exc, BAD_INPUT):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def record_rank_error(run_dir: str | Path, rank: object, message: str) -> bool:
    """Write "rank N: message" to the run dir's rank-error.txt unless a rank already did.

    O_CREAT|O_EXCL makes the first writer win without a lock, also across nodes on a
    shared file system. Returns whether this call wrote it; never raises (a rank that
    cannot write it still prints the line to its log).
    """
    try:
        fd = os.open(RunDir(str(run_dir)).rank_error, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(f"rank {rank}: {message}\n")
    return True


def _this_rank() -> object:
    """This rank's number from the environment, however far start-up got ('?' if unknown)."""
    from meshrun.launcher.rank.env import rank_env

    try:
        return rank_env(os.environ).rank
    except Exception:  # an inconsistent environment: say what we can
        return os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "?"


def fail(run_dir: str, exc: BaseException) -> None:
    """Print the error's line to this rank's log and record it in the run dir."""
    line = one_line(exc)
    print(f"meshrun launcher: error: {line}", file=sys.stderr, flush=True)
    record_rank_error(run_dir, _this_rank(), line)


def reports_fatal_errors(run: Callable[..., int]) -> Callable[..., int]:
    """Wrap `run_rank(run_dir, ...)`: bad input becomes one line, rank-error.txt and exit 2;
    any other exception is recorded the same way and raised on (its traceback stays in the log)."""

    @functools.wraps(run)
    def wrapper(run_dir: str, *args: object, **kwargs: object) -> int:
        try:
            return run(run_dir, *args, **kwargs)
        except BAD_INPUT as exc:
            fail(run_dir, exc)
            _record_exit(run_dir, EXIT_INPUT)
            return EXIT_INPUT
        except Exception as exc:
            fail(run_dir, exc)
            raise

    return wrapper


def _record_exit(run_dir: str, code: int) -> None:
    """Any rank: its peers may be killed (kill-on-bad-exit) before rank 0 could record the code."""
    try:
        record_exit(Path(run_dir), code)
    except OSError:
        pass  # no run dir to write to: the exit status stands


def read_rank_error(run_dir: str | Path) -> Optional[str]:
    """The recorded line, if any (for readers on the rank side and in tests)."""
    try:
        return Path(RunDir(str(run_dir)).rank_error).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
