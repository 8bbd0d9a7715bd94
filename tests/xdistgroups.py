"""The suite in parallel (pytest-xdist, as scripts/test.sh runs it), each worker with its own testbed.

Every worker starts its own Slurm testbed and sshd the first time one of its tests needs one (its own slot:
folder, ports, job ids; tests/testbed/testbed.py), so the testbed's tests share out like the rest. They go out
a file at a time: a file's tests share its module-scoped fixtures (a job submitted once, a profile), which
would otherwise run again on every worker. The controller sees only test ids, not fixtures, so a test is
judged by its file's source: it takes the `testbed` fixture, itself or through a fixture of its file, or its
body uses the testbed's modules (`tb.`, `sshbed.`). tests/conftest.py checks every collected test that takes
the fixture against this judgement. (xdist's own `xdist_group` marker cannot do this under pytest 9: the
suffix xdist writes into a test's id no longer reaches the id its scheduler groups by.)

Likewise the tests of a file that take one of its module-scoped fixtures (a wheel built and installed, every
ZeRO stage trained by one pair of ranks, a journey's reference run) go to one worker together: spread over three,
each worker built the fixture again (on 2 cores, the suite spent ~250 s of CPU on such repeats). A fixture whose
result is computed once for the whole session (tests/helpers/shared.py `computed_once`: the numerics' references,
whose 24 layouts would make a long queue on one worker) leaves its tests free to go anywhere.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

REPO = Path(__file__).resolve().parents[1]
TESTBED_GROUP = "testbed"
TESTBED_FIXTURE = "testbed"
TESTBED_MODULES = ("tb", "sshbed")  # the names the test files give tests/testbed/testbed.py and sshbed.py


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _uses_modules(function: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in TESTBED_MODULES
        for n in ast.walk(function)
    )


@cache
def testbed_tests(path: str) -> frozenset[str]:
    """The names of the test functions in the file at `path` (relative to the repo, as in a test id) that
    reach the testbed: through the fixture (directly or through the file's own fixtures) or its modules."""
    try:
        functions = _functions(ast.parse((REPO / path).read_text()))
    except (OSError, SyntaxError):
        return frozenset()
    reaching = {TESTBED_FIXTURE}
    changed = True
    while changed:  # fixtures of this file that take (a fixture that takes) the testbed
        changed = False
        for name, function in functions.items():
            args = {a.arg for a in function.args.args}
            if name not in reaching and (args & reaching or _uses_modules(function)):
                reaching.add(name)
                changed = True
    return frozenset(name for name in reaching if name.startswith("test") and name != TESTBED_FIXTURE)


def _module_scoped(function: ast.FunctionDef) -> bool:
    """Whether `function` is a fixture shared beyond one test: @pytest.fixture(scope="module" | "package")."""
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and "fixture" in ast.unparse(decorator.func):
            for keyword in decorator.keywords:
                if keyword.arg == "scope" and isinstance(keyword.value, ast.Constant):
                    return keyword.value.value in ("module", "package")
    return False


def _once(function: ast.FunctionDef) -> bool:
    """Whether the fixture computes its result once for the whole session (tests/helpers/shared.py): its tests
    may then run anywhere."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "computed_once"
        for n in ast.walk(function)
    )


@cache
def shared_fixture_tests(path: str) -> frozenset[str]:
    """The names of the test functions in the file at `path` that take one of its module-scoped fixtures."""
    try:
        functions = _functions(ast.parse((REPO / path).read_text()))
    except (OSError, SyntaxError):
        return frozenset()
    shared = {name for name, function in functions.items() if _module_scoped(function) and not _once(function)}
    return frozenset(
        name
        for name, function in functions.items()
        if name.startswith("test") and {a.arg for a in function.args.args} & shared
    )


def _test_name(nodeid: str) -> tuple[str, str]:
    path, _, rest = nodeid.partition("::")
    return path, rest.split("::")[-1].split("[", 1)[0]


def in_testbed_group(nodeid: str) -> bool:
    path, name = _test_name(nodeid)
    return name in testbed_tests(path)


def in_shared_fixture_group(nodeid: str) -> bool:
    path, name = _test_name(nodeid)
    return name in shared_fixture_tests(path)


class TestbedScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduler where a scope is one test, except that the tests of one file that reach
    the testbed are one scope (one worker and its testbed runs them all), and so are those that share one of the
    file's module-scoped fixtures."""

    def _split_scope(self, nodeid: str) -> str:
        if in_testbed_group(nodeid):
            return f"{TESTBED_GROUP}:{nodeid.partition('::')[0]}"
        if in_shared_fixture_group(nodeid):
            return f"shared-fixture:{nodeid.partition('::')[0]}"
        return nodeid
