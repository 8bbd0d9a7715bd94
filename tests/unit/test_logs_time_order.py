"""`meshrun logs --rank all` in the order the lines were written (not rank by rank, out of time order)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from meshrun.launcher.contract.records import logtimes
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.submit.transport.base import LocalTransport
from meshrun.submit.views.logs import Printer, Source, print_in_time_order, print_once


def _write(run_dir: Path, rank: int, parts: list[tuple[float, str]]) -> None:
    """The rank's log written part by part, the sidecar's sampler ticking after each (at the part's time)."""
    sampler = logtimes.LogTimes(str(run_dir), [rank])
    log = Path(RunDir(str(run_dir)).rank_log(rank))
    log.parent.mkdir(parents=True, exist_ok=True)
    for when, text in parts:
        with open(log, "a") as handle:
            handle.write(text)
        sampler.tick(when)


def _sources(run_dir: Path) -> list[Source]:
    rd = RunDir(str(run_dir))
    return [Source(rd.rank_log(r), f"[rank {r}] ".encode(), times=logtimes.times_path(str(run_dir), r)) for r in (0, 1)]


def test_two_ranks_lines_print_in_the_order_they_were_written(tmp_path: Path) -> None:
    _write(tmp_path, 0, [(100.0, "a start\n"), (103.0, "a step 1\na step 2\n"), (107.0, "a done\n")])
    _write(tmp_path, 1, [(101.0, "b start\n"), (102.0, "b step 1\n"), (105.0, "b error\n")])
    out = io.BytesIO()
    print_once(LocalTransport(), _sources(tmp_path), Printer(out, merged=True))
    assert out.getvalue().decode().splitlines() == [
        "[rank 0] a start",
        "[rank 1] b start",
        "[rank 1] b step 1",
        "[rank 0] a step 1",
        "[rank 0] a step 2",
        "[rank 1] b error",
        "[rank 0] a done",
    ]
    times = Path(logtimes.times_path(str(tmp_path), 0))
    assert times.read_text().splitlines()[0] == "100.000 8" and oct(times.stat().st_mode & 0o777) == "0o600"


def test_untimed_lines_come_last_rank_by_rank_and_offsets_count_every_byte(tmp_path: Path) -> None:
    """Lines the sampler has not seen yet (or a job without a sidecar) follow, each rank's in its order; a
    partial last line waits for its end, and what is printed is counted so a follow goes on from there."""
    _write(tmp_path, 0, [(100.0, "a start\n")])
    _write(tmp_path, 1, [(99.0, "b start\n")])
    rd = RunDir(str(tmp_path))
    with open(rd.rank_log(0), "a") as handle:
        handle.write("a later\na part")
    with open(rd.rank_log(1), "a") as handle:
        handle.write("b later\n")
    sources = _sources(tmp_path)
    out = io.BytesIO()
    print_in_time_order(LocalTransport(), sources, Printer(out, merged=True))
    assert out.getvalue().decode().splitlines() == [
        "[rank 1] b start",
        "[rank 0] a start",
        "[rank 0] a later",
        "[rank 1] b later",
    ]
    assert [s.offset for s in sources] == [os.path.getsize(rd.rank_log(0)), os.path.getsize(rd.rank_log(1))]
    assert sources[0].partial == b"a part"
    printer = Printer(out, merged=True)
    printer.emit(sources[0], b" ends\n")  # the follow goes on: the line is completed, not repeated
    assert out.getvalue().decode().splitlines()[-1] == "[rank 0] a part ends"
