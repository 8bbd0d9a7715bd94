"""The caller's side without a cluster: a cluster profile is named after its file and a job goes back to the
file it was submitted with, the registry is private, and input checks refuse what would fail later (`--after`
ids, a relative data.path, an export output that is a folder, a resume `--set` of what may not change, a
trailing newline or full-width digits). The items are what a new user hit; an unreachable
cluster in status and --watch is in test_transport_status.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshrun.submit import api
from meshrun.submit.cli.common import profile_path_of
from meshrun.submit.config.cluster import SHIPPED_DIR, load_profile
from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.errors import InputError
from meshrun.submit.jobs.checkpoints import check_output, with_overrides
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers.slurm_cli import dependency

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"


@pytest.fixture
def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def test_readmes_copy_step_names_the_profile_after_its_file(user_home: Path) -> None:
    """Item 2: a copy of h100-ndr.yaml saved as mycluster.yaml is mycluster, and jobs keep its file."""
    clusters = user_home / "config" / "meshrun" / "clusters"
    clusters.mkdir(parents=True)
    shutil.copy(SHIPPED_DIR / "h100-ndr.yaml", clusters / "mycluster.yaml")
    assert load_profile("mycluster").name == "mycluster"
    assert profile_path_of("mycluster") == str((clusters / "mycluster.yaml").resolve())
    (clusters / "other.yaml").write_text((SHIPPED_DIR / "h100-ndr.yaml").read_text() + "name: h100-ndr\n")
    with pytest.raises(InputError, match="a profile's name is its file name"):
        load_profile("other")


def test_a_record_goes_back_to_the_profile_file_it_was_submitted_with(user_home: Path) -> None:
    clusters = api.Clusters()
    mine = user_home / "testbed.yaml"  # same name as a shipped profile, another file
    data = yaml.safe_load((SHIPPED_DIR / "testbed.yaml").read_text())
    mine.write_text(yaml.safe_dump({**data, "description": "my own testbed"}))
    record = JobRecord("1", "testbed", "n", "/r", "slurm", 0.0, None, "h", profile=str(mine))
    assert clusters.profile_for(record).description == "my own testbed"
    assert load_profile("testbed").description != "my own testbed"


def test_the_registry_is_private(user_home: Path) -> None:
    """Item 4: 0700 folder, 0600 file, whatever the umask."""
    old = os.umask(0o022)
    try:
        Registry().add(JobRecord("1", "c", "n", "/r", "slurm", 0.0, None, "h"))
    finally:
        os.umask(old)
    path = user_home / "state" / "meshrun" / "registry.sqlite"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700


def test_a_registry_from_before_clusters_were_chosen_gains_the_column_and_keeps_its_jobs(user_home: Path) -> None:
    import sqlite3

    path = user_home / "state" / "meshrun" / "registry.sqlite"
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:  # the table as meshrun wrote it before `chosen`
        db.execute(
            "CREATE TABLE jobs (job_id TEXT NOT NULL, cluster TEXT NOT NULL, name TEXT NOT NULL, run_dir TEXT NOT NULL,"
            " scheduler TEXT NOT NULL, submitted_at REAL NOT NULL, git_sha TEXT, spec_hash TEXT NOT NULL,"
            " last_state TEXT NOT NULL DEFAULT 'SUBMITTED', profile TEXT, last_progress TEXT,"
            " PRIMARY KEY (cluster, job_id))"
        )
        db.execute(
            "INSERT INTO jobs (job_id, cluster, name, run_dir, scheduler, submitted_at, spec_hash)"
            " VALUES ('7', 'c', 'n', '/r', 'slurm', 1.0, 'h')"
        )
    db.close()
    registry = Registry()
    (old,) = registry.recent()
    assert old.job_id == "7" and old.chosen is None
    registry.set_chosen(old, "soonest of 2 asked")
    assert registry.find("7").chosen == "soonest of 2 asked"


@pytest.mark.parametrize("value", ["１２３", "123\n", "12 3", "any:１"])
def test_after_takes_ascii_job_ids_only(value: str) -> None:
    """Item 21: full-width digits and a trailing newline passed validation, then sbatch failed."""
    with pytest.raises(InputError, match="--after"):
        dependency([value])


def test_a_relative_data_path_is_refused_at_plan_time() -> None:
    """Item 25."""
    with pytest.raises(InputError, match="data.path: 'data/tokens.u16': give an absolute path"):
        plan_file(TINY, load_profile("local"), ["data.path=data/tokens.u16"], home="/h")
    plan_file(TINY, load_profile("local"), ["data.path=~/tokens.u16"], home="/h")


def test_export_output_must_be_a_file_in_an_existing_folder(tmp_path: Path) -> None:
    """Item 20: no IsADirectoryError, no raw I/O error, before anything runs."""
    with pytest.raises(InputError, match="is a folder"):
        check_output(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        check_output(tmp_path / "missing" / "m.safetensors")
    assert check_output(tmp_path / "m.safetensors") == tmp_path / "m.safetensors"


def test_resume_set_changes_only_what_may_change() -> None:
    """Item 17: a supported way to change steps, the lr schedule, restarts on a resume."""
    run_spec = plan_file(TINY, load_profile("local"), home="/h").run_spec
    longer = with_overrides(run_spec, ["train.steps=500", "checkpoint.max_requeues=3"])
    assert longer.job.trainer.steps == 500 and longer.job.checkpoint.max_requeues == 3
    with pytest.raises(InputError, match="a resume may change only"):
        with_overrides(run_spec, ["train.model.d_model=256"])
    with pytest.raises(InputError, match="train.steps"):
        with_overrides(run_spec, ["train.steps=-1"])


def test_validators_refuse_a_trailing_newline_and_non_ascii_digits() -> None:
    """Why: a `$`-anchored regex accepts "X\\n", and `\\d` accepts full-width digits."""
    from meshrun.launcher.contract.spec import schema
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.submit.core.plan import parse_time

    with pytest.raises(schema.SchemaError, match="env"):
        schema.load(JobSpec, {"name": "x", "env": {"A\n": "1"}})
    with pytest.raises(InputError, match="resources.time"):
        parse_time("１０:００")


def test_a_profile_whose_scheduler_runs_here_refuses_an_ssh_section(user_home: Path) -> None:
    """The scheduler's backend judges the profile (config never looks a backend up), for every verb's load."""
    mine = user_home / "mine.yaml"
    mine.write_text((SHIPPED_DIR / "local.yaml").read_text() + "ssh:\n  host: login\n")
    with pytest.raises(InputError, match=r"^ssh: 'login': a local cluster runs on this machine; remove `ssh`"):
        api.load_cluster(str(mine))
    with pytest.raises(InputError, match="remove `ssh`"):
        api.Clusters().profile(str(mine.resolve()))
    assert api.load_cluster("local").ssh is None


def test_meshrun_clusters_folders_override_the_shipped_profiles_and_the_users_own_override_them(
    user_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    team, lab = user_home / "team", user_home / "lab"
    mine = user_home / "config" / "meshrun" / "clusters"
    for folder in (team, lab, mine):
        folder.mkdir(parents=True)
    shipped = yaml.safe_load((SHIPPED_DIR / "testbed.yaml").read_text())
    for folder, name, said in ((team, "testbed", "team"), (team, "gpu", "team"), (lab, "gpu", "lab")):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({**shipped, "description": said}))
    monkeypatch.setenv("MESHRUN_CLUSTERS", f"{team}:{lab}:")
    assert load_profile("testbed").description == "team"
    assert load_profile("gpu").description == "lab"  # a later folder wins
    (mine / "gpu.yaml").write_text(yaml.safe_dump({**shipped, "description": "mine"}))
    assert load_profile("gpu").description == "mine"
    listed = subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", "clusters"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    row = {line.split()[0]: line for line in listed[1:]}
    assert " MESHRUN_CLUSTERS " in row["testbed"] and " yours " in row["gpu"], listed
    assert " shipped " in row["local"], listed
    monkeypatch.delenv("MESHRUN_CLUSTERS")
    assert load_profile("testbed").description == shipped["description"]
