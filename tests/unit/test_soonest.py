"""`submit -c any` / `-c a,b,c` (submit/api.py `candidates`, submit/planning/soonest.py): each login node is asked
once, over one connection and one round trip for all its partitions' checks, and a tie on start is broken on
what matters (predicted finish, free nodes, then the order written), the table's last line saying which rule.

The login nodes here are this machine's shell behind a recording `connect`, with a fake `sbatch` (Slurm's own
`--test-only` sentence, an idle partition's estimate being the second it is asked) and a fake `sinfo`; the real
Slurm's answers: tests/integration/test_preflight.py."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import yaml

from meshrun.submit import api
from meshrun.submit.api import Candidate, choose, soonest
from meshrun.submit.transport.base import LocalTransport, Result

REPO = Path(__file__).resolve().parents[2]

# Partition debug is busy for two hours; high and wide start at once (the estimate: the second sbatch is asked,
# wide's a second later than high's), wide with an idle node. Every call is logged, one line each.
SBATCH = """#!/bin/sh
for a in "$@"; do f=$a; done
p=$(sed -n 's/^#SBATCH --partition=//p' "$f")
echo "test-only $p" >> "$MESHRUN_FAKE_LOG"
[ "$p" != wide ] || sleep 1
case $p in debug) t=$(date -d '+2 hours' +%Y-%m-%dT%H:%M:%S);; *) t=$(date +%Y-%m-%dT%H:%M:%S);; esac
echo "sbatch: Job 3 to start at $t using 4 processors on nodes n1 in partition $p" >&2
"""
SINFO = """#!/bin/sh
echo "sinfo $*" >> "$MESHRUN_FAKE_LOG"
case $* in *--partition=wide*) echo "1 idle"; echo "2 alloc";; *) echo "2 alloc";; esac
"""


class Recorder:
    """`connect` for the test: one LocalTransport per connection (PATH with the fake Slurm), each command counted."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.connections: list[str] = []
        self.runs: list[str] = []

    def connect(self, ssh: Any, cluster: str = "CLUSTER") -> LocalTransport:
        where = ssh.host if ssh is not None else "this machine"
        self.connections.append(where)
        runs = self.runs

        class Counted(LocalTransport):
            def run(self, argv: Sequence[str], *args: Any, **kwargs: Any) -> Result:
                runs.append(where)
                return super().run(argv, *args, **kwargs)

        return Counted(self.env)


def _profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Recorder, Path]:
    """a1 and a2 reach login-a (a2 with its own setup line), b reaches login-b with only `wide`."""
    home, fake = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    fake.mkdir()
    for name, text in (("sbatch", SBATCH), ("sinfo", SINFO)):
        (fake / name).write_text(text)
        (fake / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "HOME": str(home), "MESHRUN_FAKE_LOG": str(log)}
    monkeypatch.setenv("HOME", str(home))  # no ~/.ssh/config, calibration or profiles of the user's
    recorder = Recorder(env)
    monkeypatch.setattr(api, "connect", recorder.connect)
    base = yaml.safe_load((REPO / "cluster_configs" / "testbed.yaml").read_text())
    base = {**base, "setup": [], "python": sys.executable, "paths": {"work_dir": "~/work"}}
    profiles = {
        "a1": {**base, "ssh": {"host": "login-a", "user": "u", "port": 22}},
        "a2": {**base, "ssh": {"host": "login-a", "user": "u", "port": 22}, "setup": ["true"]},
        "b": {
            **base,
            "ssh": {"host": "login-b", "user": "u", "port": 22},
            "partitions": [{**p, "default": True} for p in base["partitions"] if p["name"] == "wide"],
        },
    }
    files = []
    for name, data in profiles.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        files.append(str(path))
    return files, recorder, log


def _overrides(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "tokens.u16"
    corpus.write_bytes(b"\1\0" * 8192)  # token ids: the preflight's file check looks into it
    return [f"data.path={corpus}", "resources.nodes=1", "parallel.dp=2"]


def test_each_login_node_is_asked_once_and_a_tie_on_start_goes_to_the_free_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, recorder, log = _profiles(tmp_path, monkeypatch)
    found = api.candidates(REPO / "examples" / "tiny.yaml", files, _overrides(tmp_path))
    assert [(c.cluster, c.partition) for c in found] == [
        *[("a1", p) for p in ("debug", "high", "wide")],
        *[("a2", p) for p in ("debug", "high", "wide")],
        ("b", "wide"),
    ], found  # the order written, whatever order the login nodes answered in
    assert all(c.ok for c in found), [c.why for c in found]
    # One connection a login node (a1 and a2 share login-a's), each with one probe and ONE round trip of checks.
    assert sorted(recorder.connections) == ["login-a", "login-b"], recorder.connections
    assert sorted(recorder.runs) == ["login-a"] * 2 + ["login-b"] * 2, recorder.runs
    # Each partition asked of Slurm once a login node: a1's and a2's same request is one question.
    calls = log.read_text().splitlines()
    assert sorted(c for c in calls if c.startswith("test-only")) == [
        "test-only debug",
        "test-only high",
        "test-only wide",
        "test-only wide",
    ], calls
    by = {(c.cluster, c.partition): c for c in found}
    assert by["a1", "debug"].wait_s is not None and by["a1", "debug"].wait_s > 7000  # two hours
    assert by["a2", "high"].wait_s is not None and by["a2", "high"].wait_s < 5  # the clock read just before
    assert (by["a1", "wide"].free_nodes, by["a1", "high"].free_nodes) == (1, 0)
    chosen = choose(found)
    assert chosen is not None and (chosen.candidate.cluster, chosen.candidate.partition) == ("a1", "wide")
    assert chosen.rule.startswith("tie on start (a1/high, a1/wide, a2/high, a2/wide, b/wide"), chosen.rule
    assert chosen.rule.endswith(": more free nodes (1 idle), then the first written"), chosen.rule


def test_the_table_says_which_rule_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.submit.cli.main import main

    files, _, _ = _profiles(tmp_path, monkeypatch)
    sets = [word for item in _overrides(tmp_path) for word in ("--set", item)]
    assert main(["submit", str(REPO / "examples" / "tiny.yaml"), "-c", ",".join(files), *sets, "--check"]) == 0
    err = capsys.readouterr().err.splitlines()
    header = next(line for line in err if line.startswith("CLUSTER "))
    assert header.split()[:7] == ["CLUSTER", "PARTITION", "STARTS", "STEP", "FINISH", "FREE", "WHY"], err
    high = next(line for line in err if line.startswith("a1 ") and " high " in line)
    assert high.split()[5] == "0", err
    chose = next(line for line in err if line.startswith("# chose "))
    assert chose.startswith("# chose a1, partition wide: soonest of 7 asked (a1/debug, "), chose
    assert ": tie on start (" in chose and "more free nodes (1 idle), then the first written;" in chose, chose


def _at(cluster: str, wait: Optional[float], **more: Any) -> Candidate:
    start = "never" if wait is None else f"2026-12-03T22:00:{int(wait):02d}"
    return Candidate(cluster, "p", start, "", cluster, wait_s=wait, **more)


def test_starts_a_few_seconds_apart_tie_and_the_earlier_finish_wins() -> None:
    asked_first = _at("first", 0.0, limit_s=7200)  # an idle partition, asked first: its "now" is the earliest
    asked_later = _at("later", 4.0, limit_s=3600)  # asked 4 s later, and its limit ends an hour sooner
    chosen = choose([asked_first, asked_later])
    assert chosen is not None and chosen.candidate is asked_later
    assert chosen.rule == (
        "tie on start (first/p, later/p start within 10 s of each other): "
        "earlier predicted finish (its time limit 1h00m, against its time limit 2h00m)"
    )
    timed = _at("timed", 8.0, limit_s=7200, step_s=0.5, steps=100)  # the planner's 50 s run beats a limit
    assert soonest([asked_first, asked_later, timed]) is timed
    queued = _at("queued", 40.0, limit_s=60)  # 40 s of queue is a later start, not a tie
    best = choose([queued, asked_first])
    assert best is not None and best.candidate is asked_first and best.rule == "the soonest start"


def test_a_full_tie_goes_to_the_more_free_nodes_then_to_the_first_written() -> None:
    unknown = _at("unknown", 1.0, limit_s=60)
    busy = _at("busy", 0.0, limit_s=60, free_nodes=0)
    free = _at("free", 3.0, limit_s=60, free_nodes=2)
    chosen = choose([unknown, busy, free])
    assert chosen is not None and chosen.candidate is free
    assert chosen.rule.endswith(": more free nodes (2 idle)"), chosen.rule
    alike = _at("alike", 2.0, limit_s=60, free_nodes=2)
    chosen = choose([unknown, alike, free])
    assert chosen is not None and chosen.candidate is alike
    assert chosen.rule.endswith(": more free nodes (2 idle), then the first written"), chosen.rule
    assert choose([Candidate("x", "p", None, "refused")]) is None
