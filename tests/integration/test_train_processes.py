"""Real torch.distributed ranks: `python -m meshrun.launcher RUN_DIR` in separate processes over gloo.

Each rank gets the variables torchrun would set, as a cluster launcher does. The
model is tiny (2 layers, d_model 64, seq 64) so the file stays well under a minute
on 2 cores; most of the time is processes importing torch.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.ranks import _STRIPPED, _TORCHRUN, STEPS, finish, make_run, metrics, start


def test_data_parallel_trains_and_matches_one_process(tmp_path: Path, corpus: Path) -> None:
    runs = {
        "single": make_run(tmp_path, "single", corpus, 1, micro=4),
        "fsdp": make_run(tmp_path, "fsdp", corpus, 2, micro=2),
        "ddp": make_run(tmp_path, "ddp", corpus, 2, micro=4, mode="ddp"),
    }
    # All three at once: their torch imports overlap, which is most of the wall time.
    procs = {name: start(run_dir, 2 if name != "single" else 1) for name, run_dir in runs.items()}
    outputs = {name: finish(p) for name, p in procs.items()}
    single, fsdp, ddp = (metrics(runs[n]) for n in ("single", "fsdp", "ddp"))

    assert [m["step"] for m in fsdp] == list(range(1, STEPS + 1))
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "elapsed_s", "tokens", "data_wait_s"}
    assert keys <= set(fsdp[0]) and "val_loss" in fsdp[9] and "val_loss" not in fsdp[0]
    assert abs(fsdp[9]["val_ppl"] - math.exp(fsdp[9]["val_loss"])) < 1e-6 * fsdp[9]["val_ppl"]
    assert fsdp[-1]["loss"] < fsdp[0]["loss"] - 1.0, [m["loss"] for m in fsdp]
    assert fsdp[-1]["tokens"] == STEPS * 8 * 64
    for other in (fsdp, ddp):
        for a, b in zip(single, other):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
        assert abs(single[-1]["val_loss"] - other[-1]["val_loss"]) < 1e-5
    assert f"step {STEPS}/{STEPS} loss" in outputs["fsdp"][0] and " data_wait " in outputs["fsdp"][0]
    assert "step 1/" not in outputs["fsdp"][1]  # only rank 0 logs


def test_command_job_runs_the_users_program_with_torchrun_variables(tmp_path: Path, corpus: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],\n"
        "      os.environ['MASTER_ADDR'], os.environ['GREETING'])\n"
    )
    run_dir = make_run(
        tmp_path, "cmd", corpus, 2, command=(sys.executable, str(script)), env={"GREETING": "hello there"}
    )
    outputs = finish(start(run_dir, 2))
    # Each rank announces itself, then the user's program prints.
    assert [o.strip().splitlines()[-1] for o in outputs] == [
        "rank 0 of 2 127.0.0.1 hello there",
        "rank 1 of 2 127.0.0.1 hello there",
    ]
    assert [o.splitlines()[0].split()[:3] for o in outputs] == [
        ["[meshrun]", "rank", "0/2"],
        ["[meshrun]", "rank", "1/2"],
    ]


@pytest.fixture
def own_environ() -> Iterator[None]:
    """os.environ without scheduler/torchrun variables, restored whole afterwards.

    `main` runs the launcher in this process, and the launcher exports RANK, WORLD_SIZE,
    MASTER_ADDR... into os.environ (as a rank must); left behind, they would make every
    later test's ranks believe they are rank 0 of 1.
    """
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith(_STRIPPED) or k in _TORCHRUN]:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_user_errors_exit_2_with_one_line(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str], own_environ: None
) -> None:
    from meshrun.launcher.__main__ import main

    assert main(["launcher"]) == 2
    assert "usage: python -m meshrun.launcher RUN_DIR" in capsys.readouterr().err

    wrong_layout = make_run(tmp_path, "tp", corpus, 1, dp=1, tp=2)
    assert main(["launcher", str(wrong_layout)]) == 2
    assert "dp(1)*tp(2)*pp(1)=2 != world size 1" in capsys.readouterr().err

    # The spec asks for 2 ranks per node, but one process started: refuse before any rendezvous.
    two = make_run(tmp_path, "two", corpus, 2)
    assert main(["launcher", str(two)]) == 2
    err = capsys.readouterr().err
    assert "1 rank(s) started but the spec asks for" in err and len(err.strip().splitlines()) == 1

    missing = make_run(tmp_path, "missing", tmp_path / "nope.u16", 1)
    assert main(["launcher", str(missing)]) == 2
    assert "meshrun data" in capsys.readouterr().err
