"""The docs runner cannot pass silently: a broken example of each kind fails, a wrong marker is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.docs import console
from tests.docs.blocks import MarkerError, parse_page
from tests.docs.runner import CLUSTER, LOCAL, run_page, selected

FENCE = "```"


def page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("~~~", FENCE))
    return path


def failures(tmp_path: Path, text: str) -> list[str]:
    return run_page(page(tmp_path, text), tmp_path / "sandbox").failures


# ------------------------------------------------------------------ each kind passes and fails


PASSING_AND_FAILING = """
    # A page

    ~~~console
    $ echo hello; echo world
    hello
    world
    ~~~

    ~~~console
    $ echo hello; echo world
    world
    hello
    ~~~

    ~~~bash
    true
    echo fine
    ~~~

    ~~~bash
    false
    echo the failure above must not be hidden by this line
    ~~~

    ~~~python
    import os
    answer = 42
    ~~~

    ~~~python
    assert answer == 41, "python blocks share one namespace, and a failed assert fails"
    ~~~

    ~~~yaml
    name: tiny
    resources: {nodes: 1, tasks_per_node: 2}
    parallel: {dp: 2}
    ~~~

    ~~~yaml
    name: tiny
    resources: {nodes: 1, tasks_per_nod: 2}
    ~~~

    ~~~yaml
    scheduler: local
    paths: {work_dir: ~/runs}
    partitions: [{name: here, default: true}]
    ~~~

    ~~~yaml
    scheduler: local
    paths: {work_dir: ~/runs, scratchh: /tmp}
    ~~~

    ~~~text
    $ false   (prose: never run)
    ~~~
"""


def test_each_kind_passes_and_fails(tmp_path: Path) -> None:
    result = run_page(page(tmp_path, PASSING_AND_FAILING), tmp_path / "sandbox")
    assert len(result.ran) == 10  # the text fence is prose
    lines = sorted(int(f.split(":", 2)[1]) for f in result.failures)
    # The second block of each pair: console (order), bash (a middle line), python, job spec, profile.
    assert lines == [11, 21, 31, 41, 52], result.report()
    report = result.report()
    assert "printed what the page does not show" in report
    assert "exited 1, the page expects 0" in report
    assert "AssertionError: python blocks share one namespace" in report
    assert "page.md:43: resources.tasks_per_nod: 2: unknown key (did you mean 'tasks_per_node'?)" in report
    assert "not a valid cluster profile" in report and "scratchh" in report


def test_a_block_the_page_depends_on_runs_first(tmp_path: Path) -> None:
    """One session per page: a file written by a marker, a `cd` and an `export` reach the later blocks."""
    text = """
        <!-- example: file work/job.yaml -->
        ~~~yaml
        name: written
        ~~~

        ~~~console
        $ cd work && export GREETING=hi
        $ grep name job.yaml; echo $GREETING
        name: written
        hi
        ~~~

        ~~~bash
        test "$GREETING" = hi && test -f job.yaml
        ~~~

        <!-- example: file ~/bin/hello -->
        ~~~bash
        echo hello from $HOME
        ~~~

        ~~~console
        $ ~/bin/hello
        hello from ~
        ~~~
    """
    assert failures(tmp_path, text) == []


# ------------------------------------------------------------------ markers


def test_skip_and_covered_by_do_not_run(tmp_path: Path) -> None:
    text = """
        <!-- example: skip needs a GPU this machine lacks -->
        ~~~bash
        exit 1
        ~~~

        <!-- example: covered-by tests/docs/test_runner.py::test_skip_and_covered_by_do_not_run -->
        ~~~console
        $ false
        ~~~
    """
    result = run_page(page(tmp_path, text), tmp_path / "sandbox")
    assert result.failures == [] and result.ran == []


@pytest.mark.parametrize(
    "marker, refusal",
    [
        ("<!-- example: skip -->", "needs a reason"),
        ("<!-- example: skip    -->", "needs a reason"),
        ("<!-- example: covered-by tests/docs/test_nothing.py::test_x -->", "no such test file"),
        ("<!-- example: covered-by tests/docs/test_runner.py::test_not_there -->", "has no 'test_not_there'"),
        ("<!-- example: covered-by tests/docs/test_runner.py::page -->", "is not a test"),
        ("<!-- example: covered-by tests/docs/test_runner.py -->", "no such test file"),
        ("<!-- example: skipp reason -->", "unknown example marker 'skipp'"),
        ("<!-- example: exit two -->", "whole number"),
        ("<!-- example: testbed now -->", "takes no argument"),
        ("<!-- example: file /etc/passwd -->", "inside the sandbox"),
    ],
)
def test_a_wrong_marker_is_refused(tmp_path: Path, marker: str, refusal: str) -> None:
    path = page(tmp_path, f"{marker}\n~~~bash\ntrue\n~~~\n")
    with pytest.raises(MarkerError, match=refusal):
        parse_page(path)
    # ... and fails the page's test, not only its parse.
    assert any(refusal in f for f in run_page(path, tmp_path / "sandbox").failures)


@pytest.mark.parametrize(
    "text, refusal",
    [
        ("<!-- example: skip far from its fence -->\n\n~~~bash\ntrue\n~~~\n", "not directly above a fence"),
        ("<!-- example: skip a reason -->\n~~~text\nprose\n~~~\n", "not an example"),
        ("<!-- example: skip a reason -->\n", "above no fence"),
        ("<!-- example: skip a -->\n<!-- example: skip b -->\n~~~bash\ntrue\n~~~\n", "given twice"),
        ("<!-- example: skip a\nreason -->\n~~~bash\ntrue\n~~~\n", "is one line"),
    ],
)
def test_a_misplaced_marker_is_refused(tmp_path: Path, text: str, refusal: str) -> None:
    with pytest.raises(MarkerError, match=refusal):
        parse_page(page(tmp_path, text))


def test_exit_marker_expects_that_code_from_the_last_command(tmp_path: Path) -> None:
    text = """
        <!-- example: exit 3 -->
        ~~~console
        $ true
        $ echo oops; exit 3
        oops
        ~~~

        <!-- example: exit 3 -->
        ~~~console
        $ exit 0
        ~~~
    """
    (failure,) = failures(tmp_path, text)
    assert "exited 0, the page expects 3" in failure


def test_a_command_past_its_timeout_fails(tmp_path: Path) -> None:
    text = """
        <!-- example: timeout 1 -->
        ~~~console
        $ sleep 30
        ~~~
    """
    (failure,) = failures(tmp_path, text)
    assert "ran past 1 s" in failure


def test_cluster_blocks_are_left_to_the_testbed_session(tmp_path: Path) -> None:
    text = """
        <!-- example: testbed -->
        ~~~console
        $ meshrun status
        ~~~

        <!-- example: file job.yaml -->
        ~~~yaml
        name: x
        ~~~

        <!-- example: ssh -->
        ~~~bash
        meshrun status
        ~~~

        ~~~bash
        true
        ~~~
    """
    blocks = parse_page(page(tmp_path, text))
    assert [b.line for b in selected(blocks, LOCAL)] == [8, 17]
    assert [b.line for b in selected(blocks, CLUSTER)] == [3, 8, 13]


# ------------------------------------------------------------------ JOB, RUN_DIR and shown output


def test_job_and_run_dir_follow_the_newest_submit(tmp_path: Path) -> None:
    text = """
        ~~~console
        $ echo "submitted job local-0123abcd on local"; echo "run dir: $HOME/runs/x"
        submitted job local-4567cdef on local
        run dir: ~/runs/x
        $ echo JOB RUN_DIR $JOB; test JOB = local-0123abcd && echo same
        local-0123abcd ~/runs/x local-0123abcd
        same
        $ echo JOB
        JOB
        $ echo "resumed job local-0123abcd as job local-89abcdef on local"
        $ test JOB = local-89abcdef && test $JOB = local-89abcdef && echo followed
        followed
        ~~~
    """
    assert failures(tmp_path, text) == []


def test_job_before_any_submit_fails(tmp_path: Path) -> None:
    (failure,) = failures(tmp_path, "~~~console\n$ meshrun status JOB\n~~~\n")
    assert "JOB is used before the page submitted a job" in failure


@pytest.mark.parametrize(
    "shown, ok",
    [
        (["b", "c"], True),  # an excerpt
        (["a", "...", "d took 1.5 s"], True),  # a gap of one or more lines
        (["a", "...", "b"], False),  # ... stands for at least one line
        (["a", "c"], False),  # a line left out without `...`
        (["c", "b"], False),  # out of order
        (["step ... of 10"], False),
        (["d took ... s"], True),
        (["job local-ffffffff at 0:00:01"], True),  # ids and times differ run to run
        (["b "], True),  # trailing spaces do not count
        ([" b"], False),  # leading ones do
    ],
)
def test_shown_output_matching(shown: list[str], ok: bool) -> None:
    printed = "a\nb\nc\nd took 1.5 s\njob local-0a1b2c3d at 0:01:07\n"
    assert console.matches(shown, printed) is ok


def test_console_text_before_a_command_is_refused() -> None:
    with pytest.raises(console.ConsoleError, match="starts with a `\\$ ` command"):
        console.parse_console("meshrun status\n")


def test_continued_command_and_its_output() -> None:
    (command,) = console.parse_console("$ echo a \\\n  b\na b\n\n")
    assert command.text == "echo a \\\n  b" and command.shown == ("a b",)


# ------------------------------------------------------------------ the sandbox


def test_meshrun_is_this_checkouts_and_runs_in_the_sandbox(tmp_path: Path) -> None:
    text = """
        ~~~console
        $ command -v meshrun; pwd
        .../bin/meshrun
        .../repo
        $ meshrun clusters
        NAME      SCHEDULER  REACHED ...
        ...
        local     local      this machine ...
        ...
        $ test -f examples/tiny.yaml && test -d .git && echo $HOME $XDG_STATE_HOME
        ~ ~/.local/state
        ~~~

        <!-- example: exit 2 -->
        ~~~console
        $ meshrun submit examples/tiny.yaml --set resources.tasks_per_nod=2 --dry-run
        meshrun: error: --set resources.tasks_per_nod=2: 'tasks_per_nod': unknown key ...
        ~~~
    """
    assert failures(tmp_path, text) == []


def test_python_blocks_exit_code_and_output(tmp_path: Path) -> None:
    text = """
        <!-- example: exit 3 -->
        ~~~python
        import sys
        sys.exit(3)
        ~~~

        ~~~python
        raise SystemExit(4)
        ~~~
    """
    (failure,) = failures(tmp_path, text)
    assert ":8: the python block ended with 4, the page expects 0" in failure


def test_a_place_sets_mycluster_and_a_laptop_has_no_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.docs.session import Session

    monkeypatch.setenv("SLURM_CONF", "/etc/slurm.conf")
    session = Session(tmp_path / "sandbox")
    try:
        assert session.env_for("local")["SLURM_CONF"] == "/etc/slurm.conf"
        assert "SLURM_CONF" not in session.env_for("ssh")
        session.enter("testbed")
        profile = session.home / ".config" / "meshrun" / "clusters" / "mycluster.yaml"
        assert "scheduler: slurm" in profile.read_text()
        # What a laptop's command left does not lose the login node's variables for later blocks.
        session.shell("export A=1", "ssh", 10, 0, False, "here")
        assert session.env["A"] == "1" and session.env["SLURM_CONF"] == "/etc/slurm.conf"
    finally:
        session.close()


def test_a_command_in_a_prose_fence_is_found(tmp_path: Path) -> None:
    from tests.docs.runner import hidden_example

    text = "~~~text\nmeshrun status JOB\n~~~\n\n~~~text\nmeshrun: error: x\n~~~\n\n~~~\nfrom submit import api\n~~~\n"
    assert [hidden_example(b) for b in parse_page(page(tmp_path, text))] == [True, False, True]


def test_a_testbed_block_sees_mycluster_as_the_testbed(tmp_path: Path, default_corpus: Path) -> None:
    """The cluster session's dispatch, without the testbed itself: a dry run sends nothing anywhere."""
    text = """
        <!-- example: testbed -->
        ~~~console
        $ meshrun submit examples/tiny.yaml -c mycluster --dry-run
        ...
        #SBATCH --partition=debug
        ...
        ~~~
    """
    result = run_page(page(tmp_path, text), tmp_path / "sandbox", CLUSTER, default_corpus)
    assert len(result.ran) == 1 and result.failures == []
    # The same page's local session has nothing to run.
    assert run_page(page(tmp_path, text), tmp_path / "sandbox2", LOCAL).ran == []


def test_a_python_block_past_its_timeout_fails_and_the_next_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    text = """
        <!-- example: timeout 1 -->
        ~~~python
        import time
        time.sleep(30)
        ~~~

        ~~~python
        print("still here")
        ~~~
    """
    (failure,) = failures(tmp_path, text)
    assert "the python block ran past 1 s" in failure
