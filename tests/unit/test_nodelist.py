"""Node lists in one form, Slurm's compressed one (a trial saw `n[1-2]` and `n1,n2` side by side)."""

from __future__ import annotations

import pytest

from meshrun.launcher.contract.nodelist import compress, normalized
from meshrun.launcher.rank.hostlist import expand_hostlist


@pytest.mark.parametrize(
    "names, text",
    [
        (["n1"], "n1"),
        (["n2", "n1"], "n[1-2]"),
        (["n3", "n1", "n2", "n5", "n1"], "n[1-3,5]"),
        (["gpu07", "gpu08", "gpu10", "login"], "gpu[07-08,10],login"),
        (["a9", "a10", "b1"], "a[9-10],b1"),
        ([], ""),
    ],
)
def test_compress_is_slurms_form_and_expands_back(names: list[str], text: str) -> None:
    assert compress(names) == text
    assert sorted(expand_hostlist(text)) == sorted(set(names))  # `scontrol show hostnames` reads it back


def test_either_form_reads_the_same() -> None:
    """A start's nodes are recorded as the batch script listed them (`n1,n2`) or as Slurm did (`n[1-2]`)."""
    assert normalized("n1,n2") == normalized("n[1-2]") == "n[1-2]"
    assert normalized("n3,n1") == "n[1,3]" and normalized("") == ""


def test_status_shows_a_restarts_nodes_in_slurms_form() -> None:
    """The goodput line's moves: one record said `n[1-2]` (SLURM_JOB_NODELIST), the next `n1,n3` (the spare's)."""
    from meshrun.submit.views.tables import goodput_line

    figures = {
        "allocated_s": 60.0,
        "parts_s": {"productive": 45.0},
        "effective_pct": 75.0,
        "attempts": [
            {"restart": 0, "in_job": 0, "nodes": "n[1-2]"},
            {"restart": 0, "in_job": 1, "nodes": "n1,n3"},
            {"restart": 0, "in_job": 2, "nodes": "n3,n1"},  # the same nodes: no move
        ],
    }
    assert goodput_line(figures).endswith("; 2 restart(s) inside the allocation (n[1-2] -> n[1,3])")
