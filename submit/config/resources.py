"""What meshrun ships besides code: the batch-script templates and the cluster profiles.

They live at the repo's top level (templates/, cluster_configs/) and install as the
data-only packages `meshrun.templates` and `meshrun.cluster_configs` (pyproject's
package-dir): found beside the package's __init__.py, from a wheel and from the editable install of a
checkout alike (through importlib.resources where the package is not a folder on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from importlib.abc import Traversable  # importlib.resources.abc only from Python 3.11

TEMPLATES = "meshrun.templates"
PROFILES = "meshrun.cluster_configs"


class NotInstalledError(RuntimeError):
    """meshrun's package data is missing: a broken or partial install, never bad input."""


def _package(name: str) -> Traversable:
    import importlib

    try:
        package = importlib.import_module(name)
    except ModuleNotFoundError:
        raise NotInstalledError(
            f"meshrun's {name} is missing: install meshrun (`pip install .` or "
            "`bash scripts/setup.sh` in a checkout), do not only put it on PYTHONPATH"
        ) from None
    init = getattr(package, "__file__", None)
    if init:  # a folder on disk (a wheel's install, a checkout's editable one)
        return Path(init).parent
    from importlib import resources  # elsewhere (a zip): ~5 ms that the folder's case need not pay

    return resources.files(package)


def template_source(name: str) -> Optional[str]:
    """The text of template `name` (e.g. "slurm.sbatch.j2"), or None if meshrun ships none so named."""
    entry = _package(TEMPLATES).joinpath(name)
    return entry.read_text(encoding="utf-8") if entry.is_file() else None


def shipped_profiles_dir() -> Path:
    """The folder of the shipped cluster profiles.

    A real folder, not just a resource: profile errors cite `file:line`, and meshrun installs
    as plain files (a wheel or an editable checkout), never from a zip.
    """
    folder = _package(PROFILES)
    if not isinstance(folder, Path):
        raise NotInstalledError(
            f"meshrun's {PROFILES} is not a folder on disk ({folder!r}): "
            "install meshrun with pip rather than importing it from a zip"
        )
    return folder
