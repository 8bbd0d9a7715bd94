"""Weights from outside a run (train.init_from): read a safetensors file's names and shapes without torch.

Torch-free and stdlib-only, so the planner can refuse a file that does not fit before anything touches
a cluster.
"""

from __future__ import annotations

from typing import Optional

from launcher.schema import SchemaError
from launcher.spec import JobSpec
from launcher.tokens import local_path, visible_here


def check_init_from(job: JobSpec, home: Optional[str] = None) -> None:
    """train.init_from names a file that exists, where this machine sees its filesystem."""
    path = job.train.init_from if job.train is not None else None
    if path and visible_here(local_path(path, home)) and not local_path(path, home).is_file():
        raise SchemaError(
            "train.init_from", path, "no such file: give a .safetensors file (`meshrun export` writes one)"
        )
