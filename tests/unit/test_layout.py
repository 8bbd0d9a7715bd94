"""The architecture, guarded: where scheduler knowledge lives and what each side may import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {
    "launcher.schema",
    "launcher.spec",
    "launcher.rundir",
    "launcher.exitcodes",
    "launcher.alerts",  # the alert record: rank 0 and the sidecars write it, status and watch read it
    "launcher.parallel_dims",
    "launcher.envcheck",
    "launcher.modelshape",  # parameter counts and FLOPs from the config: the planner sizes models with them
    "launcher.dsconfig",  # the DeepSpeed config generated from the spec: checked with it, written by the planner
    "launcher.dskeys",  # the DeepSpeed keys dsconfig checks a deepspeed: section against
    "launcher.gpus",  # GPU peaks, memory and bandwidth: the planner times and fits jobs with them
    "launcher.presets",  # model-size presets, expanded when a spec is loaded
    "launcher.tokens",  # the token file's record: the planner checks data files and takes the vocab from it
    "launcher.weights",  # train.init_from's names and shapes, read from the safetensors header
    "launcher.secrets",  # the spec's secrets: key (names and sources) and where an env: value waits on the cluster
    "launcher.hfnames",  # meshrun's GPT in Hugging Face Llama's names: init_from's shape check reads it
    "launcher.private",  # the private umask and 0700 folders: every entry point and folder maker, both sides
    "launcher.procs",  # a pid read from a file is signalled only while it is that process: local cancel uses it
    "launcher.lost",  # saved steps never complete on shared storage: status and export name the step they use
}
"""The torch-free contract: all that `submit` may import of `launcher`."""
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
        and not any(module == c or module.startswith(c + ".") for c in CONTRACT)
    }
    assert not bad, f"submit imports launcher beyond its contract ({', '.join(sorted(CONTRACT))}): {sorted(bad)}"


def test_launcher_never_imports_submit_or_paramiko() -> None:
    bad = {
        f"{path.relative_to(REPO)}: {module}"
        for path in _sources("launcher")
        for module in _imports(path)
        if module.split(".")[0] in ("submit", "paramiko")
    }
    assert not bad, sorted(bad)


def test_the_contract_modules_are_torch_free() -> None:
    for module in CONTRACT:
        path = REPO / (module.replace(".", "/") + ".py")
        heavy = {m for m in _imports(path) if m.split(".")[0] in ("torch", "numpy", "submitit")}
        assert not heavy, f"{module} imports {heavy}"
