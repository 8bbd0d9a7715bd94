"""The architecture, guarded: where scheduler knowledge lives, no import cycles, and the import contracts
that `lint-imports` (scripts/test.sh) checks kept complete."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grimp

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CONTRACT = "meshrun.launcher.contract"
"""The torch-free contract: all that `submit` may import of `launcher`. The folder is the list (pyproject's
import-linter contracts hold it)."""
PACKAGES = ("meshrun.submit", "meshrun.launcher")
SCHEDULER_TEST = re.compile(r"""scheduler\s*(==|!=|\bin\b|\bnot in\b)\s*[\(\[\{]?\s*["'](local|slurm)["']""")


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


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


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _in_any(packages: tuple[str, ...], module: str) -> bool:
    return any(_in(package, module) for package in packages)


def import_cycles(graph: grimp.ImportGraph, packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """The strongly connected sets of modules (Tarjan) among `packages`' modules: each is a cycle."""
    modules = sorted(m for m in graph.modules if _in_any(packages, m))
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if _in_any(packages, x)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in edges.get(module, []):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            found = []
            while True:
                member = stack.pop()
                found.append(member)
                if member == module:
                    break
            if len(found) > 1:
                cycles.append(sorted(found))

    for module in modules:
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """0 import cycles in the real import graph, imports inside functions included (a type-only import, under
    TYPE_CHECKING, is not one: it never runs)."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    cycles = import_cycles(graph)
    detail = [
        f"{a} -> {b} (line {d['line_number']}: {d['line_contents']})"
        for cycle in cycles
        for a in cycle
        for b in graph.find_modules_directly_imported_by(a)
        if b in cycle
        for d in graph.get_import_details(importer=a, imported=b)[:1]
    ]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import() -> None:
    graph = grimp.ImportGraph()
    a, b, c, d = (f"meshrun.submit.{name}" for name in "abcd")
    for importer, imported in ((a, b), (b, c), (c, a)):
        graph.add_import(importer=importer, imported=imported)
    graph.add_import(importer=c, imported=d)
    assert import_cycles(graph) == [[a, b, c]]


def test_the_import_contracts_forbid_submit_every_launcher_module_but_the_contract() -> None:
    """pyproject's import-linter contract lists what of `launcher` submit may not import: every module and
    folder of launcher/ but contract/, so that a new one is forbidden the day it is added."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c.get("source_modules") == ["meshrun.submit"])
    forbidden = {m for m in contract["forbidden_modules"] if m.startswith("meshrun.launcher.")}
    on_disk = {
        f"meshrun.launcher.{path.stem if path.suffix else path.name}"
        for path in (REPO / "launcher").iterdir()
        if (path.suffix == ".py" and not path.name.startswith("__")) or (path / "__init__.py").is_file()
    } - {CONTRACT}
    assert forbidden == on_disk, f"forbid these to submit in pyproject.toml: {sorted(on_disk - forbidden)}"


DESIGN_LAYERS = [
    {"meshrun.submit.cli"},
    {"meshrun.submit.api"},
    {"meshrun.submit.planning", "meshrun.submit.schedulers", "meshrun.submit.jobs"},
    {"meshrun.submit.transport", "meshrun.submit.config"},
    {"meshrun.launcher.contract"},
]
"""The layers as the design notes write them (cli -> api -> planning / schedulers / jobs -> transport / config ->
meshrun.launcher.contract), each group's members independent of one another."""


def _layer_groups(layers: list[str]) -> list[set[str]]:
    return [{member.strip() for member in layer.split("|")} for layer in layers]


def test_the_layers_contract_is_the_designs_and_the_other_keeps_its_layers() -> None:
    """pyproject's "layers: cli down to contract" is the design's layers exactly, each sibling group one layer (written
    as ordered layers, as it once was, schedulers over planning over jobs, one sibling could import another and
    lint-imports would still say KEPT). Any other layers contract may add layers of its own between the design's,
    never merge, split or order the design's groups."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {c["name"]: _layer_groups(c["layers"]) for c in config["contracts"] if c["type"] == "layers"}
    assert layered.pop("layers: cli down to contract") == DESIGN_LAYERS
    designed = set().union(*DESIGN_LAYERS)
    for name, groups in layered.items():
        kept = [group for group in groups if group & designed]
        assert kept == DESIGN_LAYERS[len(DESIGN_LAYERS) - len(kept) :], (
            f"{name}: the design's layers, in order, each group one layer: {kept}"
        )


LOOKS_UP_A_BACKEND = {"meshrun.submit.api", "meshrun.submit.executor"}
"""The modules that may ask `meshrun.submit.schedulers.backend` for a scheduler: the API (the one road) and the submitit
executor beside it (submit/executor.py). Planning, rendering, jobs, config and views are handed the
backend, or the one thing they need of it, by their caller."""


def test_backends_are_handed_in_not_looked_up() -> None:
    graph = grimp.build_graph("meshrun.submit")  # type-only imports included: they name the lookup too
    importers = set(graph.find_modules_that_directly_import("meshrun.submit.schedulers"))
    assert importers <= LOOKS_UP_A_BACKEND, f"hand these their backend: {sorted(importers - LOOKS_UP_A_BACKEND)}"


CLI_MUST_NOT_NAME = re.compile(r"from meshrun\.submit\.transport|from meshrun\.submit\.schedulers|snapshot")
"""What the CLI never names (`grep -rn "from meshrun.submit.transport\\|from meshrun.submit.schedulers\\|snapshot" submit/cli/`): the CLI parses, calls the API and prints; the code's copy on the cluster is the API's business and
what is said of it is a view's (submit/views/code.py)."""


def test_the_cli_names_no_transport_backend_or_code_snapshot() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _sources("submit/cli")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CLI_MUST_NOT_NAME.search(line)
    ]
    assert not found, "\n".join(found)
    assert CLI_MUST_NOT_NAME.search("from meshrun.submit.transport import snapshot")  # the pattern itself still bites


def test_nothing_imports_the_cli_but_the_cli() -> None:
    """The CLI is the top of both layers contracts, but the views sit only in the second, which leaves the CLI out:
    this keeps them (and anything else outside a contract) from importing it."""
    graph = grimp.build_graph("meshrun.submit")
    cli = [module for module in graph.modules if _in("meshrun.submit.cli", module)]
    importers = set().union(*(graph.find_modules_that_directly_import(module) for module in cli))
    assert not {module for module in importers if not _in("meshrun.submit.cli", module)}


BARE_NAME = re.compile(
    r"^\s*(from|import)\s+(submit|launcher)(\.|\s|$)|-m\s+(submit|launcher)\b|[\"'](submit|launcher)\.[a-z_]"
)
"""An import, a `python -m` or a dotted name of `submit` or `launcher` without `meshrun.` before it: in a checkout
it would load a second copy of a module under another name, and installed it would find another project's."""


def lines_matching(pattern: re.Pattern[str], skip: str = "") -> list[str]:
    """'file:line: text' for every line of the repository's code, templates, scripts and tests that `pattern`
    finds, but this file's own line holding `skip` (where the pattern is written down)."""
    sources = [
        path
        for folder in ("submit", "launcher", "templates", "tests", "bench", "scripts", "examples")
        for path in sorted((REPO / folder).rglob("*"))
        if path.suffix in (".py", ".j2", ".sh") and "__pycache__" not in path.parts
    ]
    return [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not (skip and path.name == Path(__file__).name and skip in line)
    ]


def test_every_import_names_meshrun_not_a_bare_submit_or_launcher() -> None:
    found = [line for line in lines_matching(BARE_NAME) if not line.startswith(f"tests/unit/{Path(__file__).name}:")]
    assert not found, "name these meshrun.submit / meshrun.launcher:\n" + "\n".join(found)
    assert BARE_NAME.search("from launcher.job import finished") and BARE_NAME.search("python -m submit.cli")
    assert not BARE_NAME.search("from meshrun.launcher import job") and not BARE_NAME.search("meshrun submit x.yaml")


ISSUE_CITATION = re.compile(r"\b[Ii]ssues? ?#?\d+")
"""An issue number cited in code, a comment, a docstring or a test: it means nothing to a reader of the repository.
Name the behaviour instead."""


def test_no_code_or_test_cites_an_issue_number() -> None:
    found = lines_matching(ISSUE_CITATION, skip="ISSUE_CITATION = ")
    assert not found, "name the behaviour, not the issue:\n" + "\n".join(found)
    number = "24"  # apart, so that this line itself cites none
    assert ISSUE_CITATION.search(f"(issue {number}, part 3)") and ISSUE_CITATION.search(f"Issue #{number}'s trial")
    assert not ISSUE_CITATION.search("an issue's fix") and not ISSUE_CITATION.search("the issues here")
