"""Templates and cluster profiles are package data, found through importlib.resources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from meshrun.submit.config.cluster import profile_files
from meshrun.submit.config.resources import shipped_profiles_dir, template_source

REPO = Path(__file__).resolve().parents[2]


def test_every_template_and_profile_of_the_repo_is_found_as_package_data() -> None:
    for template in (REPO / "templates").glob("*.j2"):
        assert template_source(template.name) == template.read_text()
    assert template_source("no-such.j2") is None
    assert shipped_profiles_dir().samefile(REPO / "cluster_configs")  # the editable install maps the folder
    assert {p.stem for p in (REPO / "cluster_configs").glob("*.yaml")} <= set(profile_files())


def test_a_checkout_on_sys_path_finds_its_templates_through_meshrun_links() -> None:
    # -S: no site-packages, so no editable install; only the checkout on sys.path (meshrun/ links its folders).
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from meshrun.submit.config.resources import template_source; "
        "print(len(template_source('slurm.sbatch.j2') or ''))"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len((REPO / "templates" / "slurm.sbatch.j2").read_text())


def test_an_install_without_its_package_data_says_how_to_install(tmp_path: Path) -> None:
    # A tree with meshrun's code but not its templates: a broken or partial install.
    (tmp_path / "meshrun").mkdir()
    for folder in ("submit", "launcher"):
        (tmp_path / "meshrun" / folder).symlink_to(REPO / folder, target_is_directory=True)
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from meshrun.submit.config.resources import template_source; "
        "template_source('slurm.sbatch.j2')"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "meshrun.submit.config.resources.NotInstalledError: meshrun's meshrun.templates is missing: install meshrun "
        "(`pip install .` or `bash scripts/setup.sh` in a checkout), do not only put it on PYTHONPATH"
    )
