"""Over SSH nothing a user writes is executed: a job name, env values, sweep values, command words
and file names holding `$(...)`, backticks, quotes and spaces reach the job literally."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import sshbed
from tests.helpers.builders import hostile
from tests.helpers.sshbed import meshrun


def odd_file(canary: Path) -> str:
    return f"odd $(touch {canary}) 'q' \"d\" `x`.txt"


# No commas: --set splits a list on them.
PROBE = (
    'import os; print("NAME=" + os.environ["MESHRUN_JOB_NAME"]); print("VALUE=" + os.environ["HOSTILE"]); '
    'print("V=" + os.environ["V"]); print("ARG=" + os.environ["ARG"]); print("ODD=" + open(os.environ["ODD"]).read())'
)


def test_hostile_values_arrive_literally_and_nothing_executes(testbed: dict, tmp_path: Path, canary: Path) -> None:
    HOSTILE, ODD_FILE = hostile(canary), odd_file(canary)
    profile = sshbed.profile(tmp_path)
    root = sshbed.project(tmp_path, {"probe.yaml": sshbed.command_spec("probe", ["true"]), ODD_FILE: HOSTILE})
    out = meshrun(
        tmp_path,
        "submit",
        str(root / "probe.yaml"),
        "-c",
        str(profile),
        "--set",
        f"name={HOSTILE}",
        "--set",
        f"env.HOSTILE={HOSTILE}",
        "--set",
        f"env.ARG={HOSTILE}",
        "--set",
        f"env.ODD={ODD_FILE}",
        "--set",
        f"command=python,-c,{PROBE}",
        "--sweep",
        f"env.V={HOSTILE},plain",
        check=True,
    )
    assert out.stdout.startswith("submitted job array ")
    array = out.stdout.split()[3]
    rows = sshbed.watch_until_done(tmp_path, array)
    assert [r["state"] for r in rows] == ["COMPLETED", "COMPLETED"], rows
    for task, value in ((0, HOSTILE), (1, "plain")):
        text = meshrun(tmp_path, "logs", f"{array}_{task}", check=True).stdout
        assert f"NAME={HOSTILE}\n" in text and f"VALUE={HOSTILE}\n" in text and f"ARG={HOSTILE}\n" in text
        assert f"V={value}\n" in text and f"ODD={HOSTILE}" in text  # the odd file shipped under its literal name
    # slurmctld has the literal job name (it travels as one sbatch argv word).
    name = subprocess.run(
        ["squeue", "--states=all", "-h", "-r", "-j", f"{array}_0", "-o", "%j"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.rstrip("\n")
    assert name == HOSTILE
    status = json.loads(meshrun(tmp_path, "status", array, "--json", check=True).stdout)
    assert [s["name"] for s in status] == [f"{HOSTILE} [env.V={HOSTILE}]", f"{HOSTILE} [env.V=plain]"]
    assert not canary.exists()


def test_newline_in_a_value_is_refused_before_connecting(testbed: dict, tmp_path: Path) -> None:
    profile = sshbed.profile(tmp_path, known_hosts=str(tmp_path / "absent"))  # connecting would fail loudly
    root = sshbed.project(tmp_path, {"probe.yaml": sshbed.command_spec("probe", ["true"])})
    out = meshrun(tmp_path, "submit", str(root / "probe.yaml"), "-c", str(profile), "--sweep", "env.V=a\nb")
    assert out.returncode == 2 and "newlines and control characters" in out.stderr
    assert "unknown host" not in out.stderr
