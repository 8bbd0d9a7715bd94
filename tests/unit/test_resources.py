"""Templates and cluster profiles are package data, found through importlib.resources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from submit.config.cluster import profile_files
from submit.config.resources import shipped_profiles_dir, template_source

REPO = Path(__file__).resolve().parents[2]


def test_every_template_and_profile_of_the_repo_is_found_as_package_data() -> None:
    for template in (REPO / "templates").glob("*.j2"):
        assert template_source(template.name) == template.read_text()
    assert template_source("no-such.j2") is None
    assert shipped_profiles_dir().samefile(REPO / "cluster_configs")  # the editable install maps the folder
    assert {p.stem for p in (REPO / "cluster_configs").glob("*.yaml")} <= set(profile_files())


def test_a_source_tree_that_was_never_installed_says_how_to_install() -> None:
    # -S: no site-packages, so no editable install; only the checkout on sys.path.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from submit.config.resources import template_source; "
        "template_source('slurm.sbatch.j2')"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "submit.config.resources.NotInstalledError: meshrun's submit.templates is missing: install meshrun "
        "(`pip install .` or `bash scripts/setup.sh` in a checkout), do not only put it on PYTHONPATH"
    )
