"""The suite's scheduler (tests/xdistgroups.py): testbed files and shared-fixture files go to one worker whole,
and never every worker is on a testbed file while other work is left."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest

pytest.importorskip("xdist")

from tests import xdistgroups  # noqa: E402
from tests.xdistgroups import pick_scope  # noqa: E402

TB_A, TB_B = "testbed:tests/integration/test_a.py", "testbed:tests/integration/test_b.py"
LOCAL = "tests/unit/test_c.py::test_one"


def test_a_worker_takes_the_queues_first_scope_while_another_worker_is_off_the_testbed() -> None:
    assert pick_scope([TB_A, LOCAL], others_on_testbed=1, workers=3) == TB_A
    assert pick_scope([LOCAL, TB_A], others_on_testbed=2, workers=3) == LOCAL


def test_the_last_worker_off_the_testbed_takes_local_work_while_there_is_some() -> None:
    assert pick_scope([TB_A, TB_B, LOCAL], others_on_testbed=2, workers=3) == LOCAL
    assert pick_scope([TB_A, TB_B], others_on_testbed=2, workers=3) == TB_A  # nothing else is left
    assert pick_scope([TB_A, LOCAL], others_on_testbed=0, workers=1) == TB_A  # one worker: the queue's order


class FakeWorker:
    def __init__(self, collection: list[str]) -> None:
        self.collection, self.sent, self.shutting_down = collection, [], False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.append([self.collection[i] for i in indexes])

    def shutdown(self) -> None:
        self.shutting_down = True


def scheduler(workers: list[FakeWorker], queue: dict[str, list[str]]) -> Any:
    sched: Any = object.__new__(xdistgroups.TestbedScheduling)  # the parts of xdist's state that assignment uses
    sched.workqueue = OrderedDict((scope, {nodeid: False for nodeid in ids}) for scope, ids in queue.items())
    sched.assigned_work = {worker: {} for worker in workers}
    sched.registered_collections = {worker: worker.collection for worker in workers}
    sched.log = lambda *_a: None
    return sched


def test_with_two_workers_on_testbed_files_the_third_gets_the_local_test() -> None:
    ids = ["tests/integration/test_a.py::t1", "tests/integration/test_b.py::t1", LOCAL]
    workers = [FakeWorker(ids) for _ in range(3)]
    sched = scheduler(
        workers, {TB_A: ids[:1], TB_B: ids[1:2], "testbed:tests/integration/test_d.py": [], LOCAL: [LOCAL]}
    )
    for worker in workers:
        sched._assign_work_unit(worker)
    assert [worker.sent for worker in workers] == [[ids[:1]], [ids[1:2]], [[LOCAL]]]
    assert list(sched.workqueue) == ["testbed:tests/integration/test_d.py"]
    sched.assigned_work[workers[0]][TB_A][ids[0]] = True  # the first worker's testbed file is done
    sched._assign_work_unit(workers[2])
    assert "testbed:tests/integration/test_d.py" in sched.assigned_work[workers[2]]
