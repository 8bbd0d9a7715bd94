"""The hang verdict (launcher/sidecar/diagnosis.py) on recorded faulthandler dumps: which thread trains,
collective or stalled, where, and the paragraph a person reads."""

from __future__ import annotations

from meshrun.launcher.sidecar import diagnosis
from meshrun.launcher.sidecar.diagnosis import Frame, Hang, RankEvidence

SITE = "/opt/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
# A rank of the built-in trainer (python -m meshrun.launcher) blocked in a gloo all_reduce, with the data
# prefetcher's thread beside it: recorded from faulthandler(all_threads=True), paths made up.
IN_ALL_REDUCE = f"""\
Thread 0x00007f1c2b7fe6c0 (most recent call first):
  File "{STDLIB}/threading.py", line 324 in wait
  File "{STDLIB}/queue.py", line 140 in put
  File "/home/u/meshrun/launcher/data/dataset.py", line 88 in _fill
  File "{STDLIB}/threading.py", line 982 in run
  File "{STDLIB}/threading.py", line 1045 in _bootstrap_inner
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f1c3a9f1740 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/u/meshrun/launcher/train/optim.py", line 55 in global_grad_norm
  File "/home/u/meshrun/launcher/train/loop.py", line 300 in train_step
  File "/home/u/meshrun/launcher/train/loop.py", line 420 in main
  File "/home/u/meshrun/launcher/__main__.py", line 5 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
# The rank that hangs: sleeping in the fault injector (time.sleep is C: no frame of its own).
STALLED = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/home/u/meshrun/launcher/testing/faults.py", line 20 in inject_hang
  File "/home/u/meshrun/launcher/train/loop.py", line 290 in train_step
  File "/home/u/meshrun/launcher/train/loop.py", line 420 in main
  File "/home/u/meshrun/launcher/__main__.py", line 5 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
# A thread started by `threading` is listed first here, and is the current one: not the trainer.
FSDP = f"""\
Current thread 0x00007f0000000003 (most recent call first):
  File "/work/train.py", line 9 in heartbeat_loop
  File "{STDLIB}/threading.py", line 982 in run
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3100 in all_gather_into_tensor
  File "{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 240 in foreach_all_gather
  File "{SITE}/torch/nn/modules/module.py", line 1750 in _call_impl
  File "/work/model.py", line 41 in forward
  File "/work/train.py", line 30 in <module>
"""


def test_parse_keeps_threads_frames_innermost_first_and_the_current_flag() -> None:
    threads = diagnosis.parse_stack(IN_ALL_REDUCE)
    assert [t.ident for t in threads] == ["0x00007f1c2b7fe6c0", "0x00007f1c3a9f1740"]
    assert [t.current for t in threads] == [False, True]
    assert threads[1].frames[0] == Frame(f"{SITE}/torch/distributed/distributed_c10d.py", 2501, "all_reduce")
    assert threads[1].frames[-1].function == "_run_module_as_main"
    assert len(threads[0].frames) == 6


def test_a_thread_dumped_twice_keeps_its_last_dump() -> None:
    threads = diagnosis.parse_stack(STALLED + "\n" + STALLED.replace("line 20", "line 21"))
    assert len(threads) == 1 and threads[0].frames[0].line == 21


def test_main_thread_is_the_one_whose_outermost_own_frame_is_the_program_entry() -> None:
    assert diagnosis.main_thread(diagnosis.parse_stack(IN_ALL_REDUCE)).ident == "0x00007f1c3a9f1740"  # type: ignore[union-attr]
    assert diagnosis.main_thread(diagnosis.parse_stack(FSDP)).ident == "0x00007f0000000002"  # type: ignore[union-attr]
    # without any <module> frame: the longest thread not started by threading
    no_entry = FSDP.replace("in <module>", "in run_forever")
    assert diagnosis.main_thread(diagnosis.parse_stack(no_entry)).ident == "0x00007f0000000002"  # type: ignore[union-attr]
    assert diagnosis.main_thread([]) is None


def test_a_rank_in_a_collective_names_it_and_its_first_caller_outside_torch() -> None:
    where = diagnosis.where_of(IN_ALL_REDUCE)
    assert where.state == "collective" and where.function == "all_reduce"
    assert where.describe() == "all_reduce (called from launcher/train/optim.py:55 global_grad_norm)"
    fsdp = diagnosis.where_of(FSDP)
    assert fsdp.state == "collective" and fsdp.function == "all_gather_into_tensor"
    assert fsdp.frame == Frame("/work/model.py", 41, "forward")  # through torch.nn's frames


def test_a_stalled_rank_names_its_innermost_own_frame_past_the_standard_library() -> None:
    where = diagnosis.where_of(STALLED)
    assert (where.state, where.describe()) == ("stalled", "inject_hang (launcher/testing/faults.py:20)")
    waiting = f"""\
Current thread 0x1 (most recent call first):
  File "{STDLIB}/threading.py", line 324 in wait
  File "/work/loader.py", line 12 in next_batch
  File "/work/train.py", line 3 in <module>
"""
    # the stdlib's Event.wait is not a collective's wait: the rank's own frame is what stalls
    assert diagnosis.where_of(waiting).describe() == "next_batch (/work/loader.py:12)"
    only_stdlib = f'Thread 0x2 (most recent call first):\n  File "{STDLIB}/selectors.py", line 9 in select\n'
    assert diagnosis.where_of(only_stdlib).describe() == f"select ({STDLIB}/selectors.py:9)"
    assert diagnosis.where_of("").state == "no stack"
    assert diagnosis.where_of(None).state == "no stack"


def test_a_function_named_like_a_collective_counts_outside_torch_too() -> None:
    text = 'Current thread 0x1 (most recent call first):\n  File "/w/t.py", line 4 in barrier\n  File "/w/t.py", line 9 in <module>\n'
    where = diagnosis.where_of(text)
    assert (where.state, where.describe()) == ("collective", "barrier (called from /w/t.py:9 <module>)")


def test_short_paths() -> None:
    assert diagnosis.short_path(f"{SITE}/torch/x.py") == "torch/x.py"
    assert diagnosis.short_path("/home/u/meshrun/launcher/testing/faults.py") == "launcher/testing/faults.py"
    assert diagnosis.short_path("/work/train.py") == "/work/train.py"


def hang(step: int = 7) -> Hang:
    return Hang("42.0", "n1", 1000.0, step, "step", 64.2, 60.0)


def test_the_verdict_names_the_stalled_rank_first_and_groups_the_waiting_ones() -> None:
    evidence = [
        RankEvidence(0, "n1", 120, 7, "step", IN_ALL_REDUCE),
        RankEvidence(1, "n1", 123, 6, "step", STALLED),
        RankEvidence(2, "n2", 130, 7, "step", IN_ALL_REDUCE),
        RankEvidence(3, "n2", 131, 7, "step", IN_ALL_REDUCE),
    ]
    text, data = diagnosis.verdict(hang(), evidence, [], 30, "/runs/r/diagnosis")
    assert text == (
        "Hang at step 7 (phase step), found by n1 after 64 s without progress (timeout 60 s). "
        "Rank 1 (n1, pid 123) stalled in inject_hang (launcher/testing/faults.py:20), not in a collective, behind at "
        "step 6; ranks 0, 2, 3 (n1, n2) wait in all_reduce (called from launcher/train/optim.py:55 global_grad_norm). "
        "Stacks, heartbeats and GPU state: /runs/r/diagnosis/. "
        "The job ends with exit 76 (no progress): Slurm requeues it from its last checkpoint (on the local "
        "cluster `meshrun resume` does)."
    )
    assert data["attempt"] == "42.0" and data["found_by"] == "n1" and data["verdict"] == text
    assert data["ranks"][1] == {
        "rank": 1,
        "node": "n1",
        "pid": 123,
        "step": 6,
        "phase": "step",
        "state": "stalled",
        "where": "inject_hang (launcher/testing/faults.py:20)",
    }
    assert [r["state"] for r in data["ranks"]] == ["collective", "stalled", "collective", "collective"]


def test_the_verdict_names_silent_ranks_and_nodes_that_never_answered() -> None:
    evidence = [RankEvidence(0, "n1", 1, 7, "step", IN_ALL_REDUCE), RankEvidence(1, "n1", 2, 7, "step", None)]
    text, data = diagnosis.verdict(hang(), evidence, ["n2"], 30, "/d")
    assert "Rank 0 (n1, pid 1) waits in all_reduce" in text
    assert "; rank 1 (n1, pid 2) gave no stack." in text
    assert "n2 sent no diagnosis within 30 s." in text
    assert data["missing_nodes"] == ["n2"] and data["ranks"][1]["state"] == "no stack"
