"""Rendering: golden files for every shipped cluster x example, and quoting that executes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.submit.config.cluster import SHIPPED_DIR, load_profile, profile_files
from meshrun.submit.errors import InputError
from meshrun.submit.folders import own_cache
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers import backend
from meshrun.submit.schedulers.render import compiled_templates, render, sbatch_label
from meshrun.submit.schedulers.slurm import BACKEND as SLURM
from tests.helpers import builders
from tests.helpers.builders import hostile

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SHIPPED = sorted(p.stem for p in (REPO / "cluster_configs").glob("*.yaml"))
HOME = "/home/user"


def _golden_text(cluster: str, example: Path) -> str:
    """The script, or the one-line error a pair that does not fit must give, with the shipped profile (not a
    copy MESHRUN_CLUSTERS may name: a parallel worker's own testbed's)."""
    profile = load_profile(str(SHIPPED_DIR / f"{cluster}.yaml"))
    scheduler = backend(profile.scheduler)  # as `meshrun submit` plans and renders: with the backend's checks
    run_dir = f"/shared/runs/{example.stem}-golden"
    try:
        plan = plan_file(example, profile, home=HOME, run_dir=run_dir, scheduler_check=scheduler.check)
    except InputError as exc:
        return f"ERROR: {exc}\n"
    return (
        render(plan, scheduler)
        .replace(sys.executable, "<python>")
        .replace(os.path.dirname(sys.executable), "<python-dir>")
    )


@pytest.mark.parametrize("cluster", SHIPPED)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(cluster: str, example: Path) -> None:
    text = _golden_text(cluster, example)
    golden = GOLDEN / f"{cluster}__{example.stem}.txt"
    if os.environ.get("MESHRUN_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden.name}: run with MESHRUN_UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text(), f"{golden.name} changed: review, then MESHRUN_UPDATE_GOLDEN=1"


def test_every_golden_file_has_a_pair() -> None:
    expected = {f"{c}__{e.stem}.txt" for c in SHIPPED for e in EXAMPLES}
    assert {p.name for p in GOLDEN.glob("*.txt")} == expected


def test_main_example_renders_on_every_shipped_cluster_that_fits() -> None:
    fits = [c for c in SHIPPED if not _golden_text(c, REPO / "examples" / "tiny.yaml").startswith("ERROR")]
    assert set(fits) == set(SHIPPED)


def test_hostile_values_are_quoted_and_reach_bash_literally(canary: Path) -> None:
    HOSTILE = hostile(canary)
    script = render(builders.plan("tiny.yaml", "testbed", f"name={HOSTILE}", f"env.HOSTILE={HOSTILE}"), SLURM)
    # Run the environment part of the script in bash and read the values back.
    lines = [l for l in script.splitlines() if l.startswith(("export MESHRUN_JOB_NAME=", "export HOSTILE="))]
    probe = "\n".join(lines + ['printf "%s\\n%s\\n" "$MESHRUN_JOB_NAME" "$HOSTILE"'])
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [HOSTILE, HOSTILE]
    assert not canary.exists()


def test_sbatch_directives_carry_only_a_safe_label(canary: Path) -> None:
    HOSTILE = hostile(canary)
    script = render(builders.plan("tiny.yaml", "testbed", f"name={HOSTILE}"), SLURM)
    directive = next(l for l in script.splitlines() if l.startswith("#SBATCH --job-name="))
    assert directive == f"#SBATCH --job-name={sbatch_label(HOSTILE)}"
    assert all(c.isalnum() or c in "._+-" for c in directive.split("=", 1)[1])


@pytest.mark.parametrize("override", ["name=a\nb", "env.X=line1\nline2", "env.Y=tab\there", "name=bell\x07"])
def test_newlines_and_control_characters_are_refused(override: str) -> None:
    with pytest.raises(InputError, match="newlines and control characters"):
        builders.plan("tiny.yaml", "testbed", override)


def test_bad_env_key_is_refused() -> None:
    with pytest.raises(InputError, match="environment variable names"):
        builders.plan("tiny.yaml", "testbed", "env.BAD-KEY=1")


def test_setup_lines_with_newlines_are_refused(tmp_path: Path) -> None:
    profile = tmp_path / "c.yaml"
    profile.write_text(
        'name: c\nscheduler: slurm\npaths: {work_dir: /w}\nsetup: ["echo a\\necho b"]\n'
        "partitions: [{name: p, cpus_per_node: 8}]\n"
    )
    with pytest.raises(InputError, match=r"c.yaml:4: setup\[0\].*newlines"):
        load_profile(str(profile))


def test_script_is_valid_bash(tmp_path: Path) -> None:
    for cluster in SHIPPED:
        for example in EXAMPLES:
            text = _golden_text(cluster, example)
            if text.startswith("ERROR"):
                continue
            path = tmp_path / "s.sh"
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)


def test_shipped_profiles_are_all_found() -> None:
    assert set(SHIPPED) <= set(profile_files())
    assert {"local", "testbed"} <= set(SHIPPED)


def test_render_o_says_the_code_snapshot_must_be_on_the_cluster_first(tmp_path: Path) -> None:
    """`render` writes nothing on the cluster: the script names a snapshot that may not be there; it says so,
    and how to put it there (`--upload`); then that it is there."""
    import yaml

    profile = yaml.safe_load((REPO / "cluster_configs" / "testbed.yaml").read_text())
    profile["paths"]["work_dir"] = str(tmp_path / "work")
    (tmp_path / "tb.yaml").write_text(yaml.safe_dump(profile))
    project = tmp_path / "proj"
    project.mkdir()
    (project / "job.yaml").write_text("name: hand\nresources: {nodes: 1, tasks_per_node: 1}\ncommand: [python, x.py]\n")
    (project / "x.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    env = dict(os.environ, HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    argv = [
        sys.executable,
        "-m",
        "meshrun.submit.cli.main",
        "render",
        str(project / "job.yaml"),
        "-c",
        str(tmp_path / "tb.yaml"),
    ]
    out = subprocess.run([*argv, "-o", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == f"wrote {tmp_path / 'job.sbatch'}" and len(lines) == 2
    code_dir = next(l.split("=", 1)[1] for l in (tmp_path / "job.sbatch").read_text().splitlines() if "CODE_DIR=" in l)
    assert lines[1].startswith(f"code: the script runs from the code snapshot {code_dir}, which is not on the cluster")
    again = f"`meshrun render {project / 'job.yaml'} -c {tmp_path / 'tb.yaml'} -o {tmp_path / 'job.sbatch'} --upload`"
    assert f"{again} (or a `meshrun submit`) uploads it" in lines[1]
    assert not (tmp_path / "work").exists()  # nothing written on the cluster
    out = subprocess.run(
        [*argv, "-o", str(tmp_path / "job.sbatch"), "--upload"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and f"code: uploaded the code snapshot {code_dir}\n" in out.stderr, out.stderr
    assert (Path(code_dir) / "x.py").read_text() == "print(1)\n" and Path(code_dir).stat().st_mode & 0o777 == 0o700
    out = subprocess.run([*argv, "-o", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)
    assert out.stderr.endswith(
        f"code: the script runs from the code snapshot {code_dir}, which is on the cluster (sealed)\n"
    )


def test_compiled_templates_are_kept_only_in_a_folder_no_one_else_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    private = tmp_path / "cache" / "meshrun" / "templates"
    assert own_cache("templates") == private and compiled_templates() is not None
    assert private.stat().st_mode & 0o777 == 0o700  # made private, whatever the umask
    monkeypatch.setattr(os, "getuid", lambda: private.stat().st_uid + 1)  # a folder another user owns
    assert own_cache("templates") is None and compiled_templates() is None  # they could plant code there
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no/such")
    assert compiled_templates() is None  # not creatable: every render compiles, as before


def test_a_script_rendered_from_compiled_templates_is_the_one_compiled_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshrun.submit.schedulers import render as rendering

    plan = plan_file(REPO / "examples" / "tiny.yaml", load_profile("local"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    scripts = []
    for _ in range(2):  # the first compiles and keeps them, the second loads them
        rendering.environment.cache_clear()
        scripts.append(render(plan, backend("local")))
    rendering.environment.cache_clear()
    assert list((tmp_path / "meshrun" / "templates").iterdir())
    assert scripts[0] == scripts[1] and scripts[0].startswith("#!/")
