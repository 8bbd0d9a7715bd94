"""The architecture, guarded: where scheduler knowledge lives and what each side may import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACT = "launcher.contract"
CONTRACT_FILES = sorted((REPO / "launcher" / "contract").glob("*.py"))
"""The torch-free contract: all that `submit` may import of `launcher`. The folder is the list."""
SCHEDULER_TEST = re.compile(r"""scheduler\s*(==|!=|\bin\b|\bnot in\b)\s*[\(\[\{]?\s*["'](local|slurm)["']""")


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_only_the_backends_test_the_scheduler_by_name() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for package in ("submit", "launcher")
        for path in _sources(package)
        if "schedulers" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SCHEDULER_TEST.search(line)
    ]
    assert not offenders, f"scheduler tested by name outside submit/schedulers/: {offenders}"


def test_the_guard_itself_sees_a_scheduler_test() -> None:
    assert SCHEDULER_TEST.search('if cluster.scheduler == "local":')
    assert SCHEDULER_TEST.search("if record.scheduler in ('slurm', 'x'):")
    assert not SCHEDULER_TEST.search("backend(cluster.scheduler).ships_code")


def test_submit_imports_only_the_torch_free_contract_of_launcher() -> None:
    bad = {
        f"{path.relative_to(REPO)}: {module}"
        for path in _sources("submit")
        for module in _imports(path)
        if module.split(".")[0] == "launcher"
        and module != "launcher"
        and not (module == CONTRACT or module.startswith(CONTRACT + "."))
    }
    assert not bad, f"submit imports launcher beyond its contract ({CONTRACT}): {sorted(bad)}"


def test_launcher_never_imports_submit_or_paramiko() -> None:
    bad = {
        f"{path.relative_to(REPO)}: {module}"
        for path in _sources("launcher")
        for module in _imports(path)
        if module.split(".")[0] in ("submit", "paramiko")
    }
    assert not bad, sorted(bad)


def test_the_contract_modules_are_torch_free() -> None:
    assert len(CONTRACT_FILES) > 10
    for path in CONTRACT_FILES:
        heavy = {m for m in _imports(path) if m.split(".")[0] in ("torch", "numpy", "submitit")}
        assert not heavy, f"{path.relative_to(REPO)} imports {heavy}"
