"""Fuzzed input (Hypothesis): whatever a user writes, meshrun answers exit 0 or exit 2 with one line.

Each property generates inputs over the real keys (walked from the spec's and the profile's
dataclasses) with values of random types, runs the real CLI in this process (`meshrun.submit.cli.main.main`) and
checks: exit 0, and then the script passes `bash -n`; or exit 2 with exactly one line on stderr
(`meshrun: error: ...`), never a traceback nor an "internal error". Hostlist expressions raise
ValueError and nothing else (tests/integration/test_hostlist_scontrol.py compares them with scontrol).

CI runs a few hundred examples per property, derandomized (the same inputs every run);
MESHRUN_SOAK=1 runs thousands, randomized. Each test prints how many inputs it tried (-s shows it).
Profiles' `setup` lines are never fuzzed (the one verbatim, trusted, part of a script), nor their
`ssh` section (render would connect to whatever host it names).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import os
import subprocess
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.rank.env import expand_hostlist
from meshrun.submit.cli.main import main
from meshrun.submit.config.cluster import ClusterProfile

REPO = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("MESHRUN_SOAK") == "1"
EXAMPLES = int(os.environ.get("MESHRUN_FUZZ_EXAMPLES", "5000")) if SOAK else 200
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not SOAK,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


def key_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree, sections included ("train", "train.model", "train.model.d_model")."""
    paths = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        paths.append(path)
        tp = typing.get_type_hints(cls)[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            paths.extend(key_paths(inner[0], path + "."))  # type: ignore[arg-type]
    return paths


SPEC_KEYS = key_paths(JobSpec)
# Not fuzzed: `setup` (verbatim by design) and `ssh` (render would connect: a cluster, not an input).
PROFILE_KEYS = [k for k in key_paths(ClusterProfile) if k not in ("name", "setup") and k.split(".")[0] != "ssh"]
TINY = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
PROFILES = {
    name: yaml.safe_load((REPO / "cluster_configs" / f"{name}.yaml").read_text()) for name in ("testbed", "local")
}

WORDS = [
    "fsdp", "ddp", "gpipe", "1f1b", "fp32", "bf16", "fp16", "native", "deepspeed", "slurm", "local", "debug",
    "00:30:00", "1-00:00:00", "soon", "~/x", "/tmp/x", "", " ", "a\nb", "\x1b[31m", "$(touch pwn)", "'; rm -rf /",
    "llama-7b", "n[1-2]", "é", "0", "-1", "1e3", "nan", "inf", "null", "true", "[a, b]", "{a: 1}",
]  # fmt: skip
scalars = st.one_of(
    st.integers(-2, 16),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(WORDS), st.text(max_size=6)), scalars, max_size=3),
)


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        child = doc.get(part)
        doc[part] = child = child if isinstance(child, dict) else {}
        doc = child
    doc[last] = value


def drop_path(doc: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        doc = doc.get(part)  # type: ignore[assignment]
        if not isinstance(doc, dict):
            return
    doc.pop(last, None)


@st.composite
def mutated(draw: st.DrawFn, base: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    """`base` with 1-4 random changes: a real (or, rarely, a misspelt) key set to a random value, or dropped."""
    doc = yaml.safe_load(yaml.safe_dump(dict(base)))  # a deep copy
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["set", "set", "set", "drop", "typo"]))
        if action == "drop":
            drop_path(doc, key)
        else:
            set_path(doc, key + ("x" if action == "typo" else ""), draw(values))
    return doc


class Outcome:
    """Every run's exit code, counted; the contract checked on each."""

    def __init__(self, name: str) -> None:
        self.name, self.codes = name, collections.Counter[int]()

    def run(self, argv: list[str]) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        text, errors = out.getvalue(), err.getvalue()
        self.codes[code] += 1
        assert code in (0, 2), (argv, code, errors)
        assert "Traceback" not in errors and "internal error" not in errors, (argv, errors)
        if code == 2:
            assert errors.startswith("meshrun: error: ") and errors.count("\n") == 1, (argv, errors)
        return code, text

    def report(self, at_least_each: int) -> None:
        tried = sum(self.codes.values())
        print(f"fuzz {self.name}: {tried} inputs tried (exit 0: {self.codes[0]}, exit 2: {self.codes[2]})")
        # Not vacuous: the generator reaches both answers.
        assert self.codes[0] >= at_least_each and self.codes[2] >= at_least_each, self.codes


def bash_parses(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert done.returncode == 0, (done.stderr, script)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for var, sub in (("HOME", "home"), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("MESHRUN_CLUSTER", raising=False)
    yield tmp_path


def render_checked(outcome: Outcome, argv: list[str]) -> None:
    code, script = outcome.run(["render", *argv])
    if code == 0:
        bash_parses(script)


def fuzz(check: Callable[..., None], **strategies: Any) -> None:
    FUZZ(given(**strategies)(check))()


def test_random_job_specs_render_or_say_what_is_wrong(home: Path) -> None:
    outcome = Outcome("job specs")
    spec = home / "job.yaml"

    def check(doc: dict[str, Any], cluster: str) -> None:
        spec.write_text(yaml.safe_dump(doc, allow_unicode=True))
        render_checked(outcome, [str(spec), "-c", cluster])

    fuzz(check, doc=mutated(TINY, SPEC_KEYS), cluster=st.sampled_from(["testbed", "local"]))
    outcome.report(EXAMPLES // 20)


def test_random_cluster_profiles_load_or_say_what_is_wrong(home: Path) -> None:
    outcome = Outcome("cluster profiles")
    profile = home / "fz.yaml"

    def check(doc: dict[str, Any]) -> None:
        profile.write_text(yaml.safe_dump(doc, allow_unicode=True))
        render_checked(outcome, [str(REPO / "examples" / "tiny.yaml"), "-c", str(profile)])

    fuzz(check, doc=st.sampled_from(list(PROFILES.values())).flatmap(lambda base: mutated(base, PROFILE_KEYS)))
    outcome.report(EXAMPLES // 20)


def test_random_set_values_apply_or_say_what_is_wrong(home: Path) -> None:
    outcome = Outcome("--set values")
    text = st.one_of(st.sampled_from(WORDS), st.text(max_size=16), st.integers().map(str), st.floats().map(str))

    def check(sets: list[tuple[str, str]], verb: str) -> None:
        argv = [verb, str(REPO / "examples" / "tiny.yaml"), "-c", "testbed"] + [f"--set={k}={v}" for k, v in sets]
        if verb == "render":
            render_checked(outcome, argv[1:])
        else:
            outcome.run(argv)

    pairs = st.tuples(st.sampled_from(SPEC_KEYS), text)
    fuzz(check, sets=st.lists(pairs, min_size=1, max_size=3), verb=st.sampled_from(["render", "plan"]))
    # Random text for up to 3 keys is mostly refused: ~5% are accepted (97 of 2,000 in a soak), so the
    # floor that proves both ways are exercised is 1 in 40, not the others' 1 in 20.
    outcome.report(EXAMPLES // 40)


YAML_ALPHABET = st.sampled_from(list("abnrt_:-[]{}, \n\t#&*!|>'\"%@`?.0123456789") + ["train:", "  ", "\x00", "é"])


def test_random_yaml_documents_load_or_say_what_is_wrong(home: Path) -> None:
    outcome = Outcome("YAML documents")
    spec = home / "job.yaml"
    documents = st.one_of(
        st.lists(YAML_ALPHABET, max_size=40).map("".join),
        st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
        # A valid spec with random text spliced in: YAML that is almost right.
        st.tuples(st.integers(0, 600), st.lists(YAML_ALPHABET, max_size=8).map("".join)).map(
            lambda cut: (t := (REPO / "examples" / "tiny.yaml").read_text())[: cut[0]] + cut[1] + t[cut[0] :]
        ),
    )

    def check(text: str) -> None:
        spec.write_bytes(text.encode("utf-8", "surrogateescape"))
        render_checked(outcome, [str(spec), "-c", "testbed"])

    fuzz(check, text=documents)
    outcome.report(5)


HOSTLIST_ALPHABET = st.sampled_from(list("ab01-,[] \t9x") + ["n[1-3]", "[0-9]", "-ib", "99999999999999999999"])


def test_random_hostlists_expand_or_raise_value_error() -> None:
    tried = collections.Counter[str]()

    def check(text: str) -> None:
        try:
            hosts = expand_hostlist(text)
        except ValueError as exc:
            tried["refused"] += 1
            assert str(exc), text
            return
        tried["expanded"] += 1
        assert all(h and "[" not in h and "]" not in h for h in hosts), (text, hosts)

    fuzz(check, text=st.one_of(st.lists(HOSTLIST_ALPHABET, max_size=30).map("".join), st.text(max_size=30)))
    print(f"fuzz hostlists: {sum(tried.values())} inputs tried ({dict(tried)})")
    assert tried["refused"] > 0 and tried["expanded"] > 0
