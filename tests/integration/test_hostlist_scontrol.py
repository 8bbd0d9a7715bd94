"""expand_hostlist against the real `scontrol show hostnames`, on generated and hand-picked lists.

`scontrol show hostnames` parses locally and never calls slurmctld, but it must load a
configuration first (without one it tries DNS SRV records and dies), so the tests hand it a
two-line slurm.conf. It prints "Invalid hostlist: ..." on stderr and still exits 0 for a list it
refuses, so refusal is read from stderr.

The generated lists are seeded (SEED, or MESHRUN_HOSTLIST_SEED to explore others) and their number
scales with `trials`: about a thousand lists in CI, tens of thousands with MESHRUN_SOAK=1.

Where the installed Slurm (22.05 on the test machine) and expand_hostlist differ on purpose:
- a suffix after the last bracket ("login[1-2]-ib") is valid from Slurm 23.11 (SchedMD commit
  0994b5f, "Extend hostlist to support suffix", June 2023; still so in 25.11); 22.05 refuses it.
  meshrun follows the Slurm that supported clusters run: refusing such a list would fail every
  job whose node list uses it there, while 22.05 never produces one. Such lists are checked
  directly when the installed scontrol takes them, else through "n[1-2]-ib[0]" (valid in 22.05:
  the same names with a "0" appended).
- an unclosed '[' is an error from 23.11; 22.05 mangles it ("n[1-3" -> "n]", "[1-3" -> "1-3").
- names that would keep a '[' or ']', and lists where Slurm logs an error yet prints (it then
  drops hosts silently), raise ValueError here.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrun.launcher.rank.env import expand_hostlist
from tests.helpers.cli import SOAK, trials

SEED = int(os.environ.get("MESHRUN_HOSTLIST_SEED", "20240611"))


@dataclass(frozen=True)
class Scontrol:
    """What `scontrol show hostnames TEXT` did."""

    hosts: list[str]
    refused: bool
    """Exit status != 0, "Invalid hostlist", or an error logged (even when it printed hosts)."""
    stderr: str


Run = Callable[[Sequence[str]], dict[str, Scontrol]]


@pytest.fixture(scope="module")
def scontrol_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A clean environment with a two-line slurm.conf (and no SLURM_JOB_NODELIST, which scontrol
    would fall back to for an empty argument)."""
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=hostlisttest\nSlurmctldHost=localhost\n")
    return {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin", "LC_ALL": "C"}


def scontrol_binary() -> str:
    binary = shutil.which("scontrol") or "/usr/bin/scontrol"
    if not Path(binary).exists():
        # Fail, never skip (as tests/integration/conftest.py): a skip would look green.
        pytest.fail("scontrol not found: run `sh tests/testbed/install.sh` as root first", pytrace=False)
    return binary


@pytest.fixture(scope="module")
def scontrol(scontrol_env: dict[str, str]) -> Run:
    binary, env = scontrol_binary(), scontrol_env

    def one(text: str) -> Scontrol:
        # "--": a list that starts with '-' must not be read as an option.
        try:
            done = subprocess.run([binary, "--", "show", "hostnames", text], env=env, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:  # a number past 64 bits can send Slurm into an endless loop
            return Scontrol([], True, "timed out")
        out = done.stdout.decode("utf-8", "surrogateescape")
        err = done.stderr.decode("utf-8", "surrogateescape")
        refused = done.returncode != 0 or "Invalid hostlist" in err or "error:" in err
        return Scontrol(out.splitlines(), refused, err)

    def run(texts: Sequence[str]) -> dict[str, Scontrol]:
        # One process per list, 16 at a time (~4 ms each). Batching through stdin would be
        # cheaper still, but its stderr cannot be matched to the command that caused it.
        unique = list(dict.fromkeys(texts))
        with ThreadPoolExecutor(max_workers=16) as pool:
            return dict(zip(unique, pool.map(one, unique)))

    probe = one("n[1-2]")
    if probe.hosts != ["n1", "n2"]:
        pytest.fail(f"scontrol show hostnames does not work here: {probe}", pytrace=False)
    return run


@pytest.fixture(scope="module")
def scontrol_version(scontrol_env: dict[str, str]) -> tuple[int, int]:
    """(major, minor) of the installed Slurm: "slurm-wlm 22.05.8" -> (22, 5)."""
    out = subprocess.run(
        [scontrol_binary(), "--version"], env=scontrol_env, capture_output=True, text=True, timeout=60
    ).stdout
    major, minor = re.findall(r"\d+", out)[:2]
    return int(major), int(minor)


def expand_or_none(text: str) -> Optional[list[str]]:
    try:
        return expand_hostlist(text)
    except ValueError:
        return None


def bracketed(hosts: list[str]) -> bool:
    return any("[" in h or "]" in h for h in hosts)


# ---- generators -----------------------------------------------------------------------------

NAMES = ["n", "node", "gpu-", "c427-", "r1n", "a.b-", "x_", "compute-0-", "N", "é"]
SUFFIXES = ["-ib", ".cluster.org", "-eth0", "x", "_a1", "-1", "-", "ib0"]
SEPARATORS = [",", ",", ",", ",", " ", "\t", ",,", ", "]


def number(rng: random.Random, width: int) -> int:
    kind = rng.random()
    if kind < 0.7:
        return rng.randrange(0, 20)
    if kind < 0.9:
        return rng.randrange(0, 10**width if width > 1 else 1000)
    return rng.randrange(10**17, 10**18)  # big, still far below 2**64


def range_item(rng: random.Random, max_span: int) -> str:
    """One valid item of a bracket: "7", "007", "3-12", "08-10", and strtoul's quirks."""
    width = rng.choice([1, 1, 1, 2, 3, 5])
    lo = number(rng, width)
    hi = lo + rng.choice([0, 0, 1, rng.randrange(0, max_span + 1)])
    lo_s, hi_s = str(lo).zfill(width), str(hi).zfill(rng.choice([1, width]))
    quirk = rng.random()
    if quirk < 0.04:
        return f" {lo_s}-{hi_s}"  # strtoul skips the space, strlen counts it: one more pad
    if quirk < 0.07:
        return f"+{lo_s}-{hi_s}"
    if quirk < 0.10:
        return f"{lo_s}-"  # no high bound: just lo
    if quirk < 0.13:
        return f"{lo_s}q-{hi_s}"  # junk before '-' goes unnoticed once hi parses
    return lo_s if hi == lo and rng.random() < 0.5 else f"{lo_s}-{hi_s}"


def bracket(rng: random.Random, max_span: int) -> str:
    items = [range_item(rng, max_span) for _ in range(rng.choice([1, 1, 2, 3, 4]))]
    return "[" + ",".join(items) + "]"


def bare_name(rng: random.Random) -> str:
    name = rng.choice(NAMES + ["", "login"])
    digits = rng.choice(["", str(rng.randrange(100)), f"{rng.randrange(1000):04d}", str(rng.randrange(10**18, 10**19))])
    return (name + digits) or "solo"


def token(rng: random.Random) -> str:
    """A token both Slurm 22.05 and expand_hostlist accept the same way: no suffix."""
    if rng.random() < 0.3:
        return bare_name(rng)
    groups = rng.choice([1, 1, 1, 2, 2, 3])
    span = {1: 40, 2: 6, 3: 3}[groups]
    text = rng.choice(NAMES + [""])
    for g in range(groups):
        text += bracket(rng, span)
        if g < groups - 1:
            text += rng.choice(["", "-", "b", "_r", ".", "c1"])
    return text


def hostlist(rng: random.Random, make: Callable[[random.Random], str]) -> str:
    return join(rng, [make(rng) for _ in range(rng.choice([1, 1, 2, 3, 5]))])


def join(rng: random.Random, tokens: list[str]) -> str:
    """Tokens joined by varied separators, sometimes with separators around the whole list."""
    text = tokens[0]
    for tok in tokens[1:]:
        text += rng.choice(SEPARATORS) + tok
    if rng.random() < 0.1:
        text = rng.choice(SEPARATORS) + text + rng.choice(SEPARATORS)
    return text


def suffixed_token(rng: random.Random) -> str:
    return rng.choice(NAMES) + bracket(rng, 40) + rng.choice(SUFFIXES)


INVALID_MUTATIONS: list[Callable[[random.Random], str]] = [
    lambda r: f"{r.randrange(5, 99)}-{r.randrange(0, 5)}",  # descending
    lambda r: "",  # empty item: "[]", "[1,]"
    lambda r: f"{r.randrange(9)}-{r.randrange(10, 99)}{r.choice('abz ')}",  # junk after high
    lambda r: r.choice(["a", "a-3", "x", "1x2", "0x1F", "-", "-4", "1--3", "1-3-5", "1-+-3"]),
    lambda r: f"{r.randrange(9)}-{r.randrange(65536, 99999)}",  # more than 65536 hosts
    lambda r: "[1-2]",  # nested brackets
    lambda r: f"{r.randrange(9)}]",  # a stray ']'
]


def invalid_hostlist(rng: random.Random) -> str:
    bad_item = rng.choice(INVALID_MUTATIONS)(rng)
    items = [range_item(rng, 5) for _ in range(rng.choice([0, 1, 2]))]
    items.insert(rng.randrange(len(items) + 1), bad_item)
    bad = rng.choice(NAMES) + "[" + ",".join(items) + "]"
    if rng.random() < 0.3:  # the bad group before another bracket
        bad += rng.choice(["b", "-", ""]) + bracket(rng, 3)
    tokens = [token(rng) for _ in range(rng.choice([0, 0, 1, 3]))]
    tokens.insert(rng.randrange(len(tokens) + 1), bad)
    return join(rng, tokens)


def junk(rng: random.Random) -> str:
    return "".join(rng.choice("ab01-,[] ") for _ in range(rng.randrange(1, 13)))


# ---- tests ------------------------------------------------------------------------------------

HAND_PICKED = [
    "n[1-3]",
    "n[01-10]",
    "n[009-011]",
    "n[5]",
    "n[1,3-5,7]",
    "n[3,1,3]",
    "a[1-2]b[3-4]",
    "a[01-03]b[1-2]",
    "a[1-2]b[3-4]c[5-6]d[7-8]",
    "n[1-3][4-5]",
    "n[1-2]-[4-5]",
    "[1-3]",
    "rack[1-2]_node[1,3]",
    "n[1-3],x",
    "a,b,,c",
    " n1  ,, n2 ",
    "a\tb c",
    "x[1-2] y[3]",
    "c427-032,c429-002,c457-[011-012]",
    "n[1-010]",
    "n[ 1-3]",
    "n[+1-3]",
    "n[1-]",
    "n[1 -3]",
    "n[1a-3]",
    "é[1-2]",
    "n[1é-3]",
    "n18446744073709551614",
    "n0,n00,n000",
    "007",
    ",",
    "n[1-2]x[3]",
    "n[0-1]b[2]",
    "a[1],b",
    "n[1-65536]",
]


def test_hand_picked_lists_match_scontrol(scontrol: Run) -> None:
    results = scontrol(HAND_PICKED)
    for text in HAND_PICKED:
        assert not results[text].refused, (text, results[text])
        assert expand_hostlist(text) == results[text].hosts, text


def test_generated_lists_match_scontrol(scontrol: Run) -> None:
    rng = random.Random(SEED)
    texts = [hostlist(rng, token) for _ in range(trials(300, 20_000))]
    results = scontrol(texts)
    mismatches = [(t, results[t]) for t in texts if results[t].refused or expand_or_none(t) != results[t].hosts]
    assert not mismatches, mismatches[:5]
    assert sum(len(r.hosts) for r in results.values()) > 8 * len(texts)  # the lists did expand
    print(f"{len(texts)} generated hostlists agree with scontrol (seed {SEED})")


def test_login_ib_suffix_is_expanded_as_slurm_23_11_does(scontrol: Run, scontrol_version: tuple[int, int]) -> None:
    # The example: the installed 22.05 refuses it, Slurm >= 23.11 gives these two names.
    text = "login[1-2]-ib"
    assert expand_hostlist(text) == ["login1-ib", "login2-ib"]
    results = scontrol([text, "login[1-2]-ib[0]"])
    if scontrol_version >= (23, 11):
        assert results[text].hosts == ["login1-ib", "login2-ib"], results[text]
    else:  # the same names, each plus "0", through a list 22.05 takes
        assert results[text].refused, (scontrol_version, results[text])
        assert results["login[1-2]-ib[0]"].hosts == ["login1-ib0", "login2-ib0"]


def test_suffix_after_the_last_bracket(scontrol: Run) -> None:
    rng = random.Random(SEED + 1)
    oracle = {}
    for _ in range(trials(100, 5_000)):
        tokens = [suffixed_token(rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        # 22.05 refuses "n[1-2]-ib" but takes "n[1-2]-ib[0]": the same names, each plus "0".
        oracle[join(rng, tokens)] = ",".join(tok + "[0]" for tok in tokens)
    texts = list(oracle)
    direct, rewritten = scontrol(texts), scontrol(list(oracle.values()))
    for text in texts:
        if not direct[text].refused:  # Slurm >= 23.11 takes the suffix itself
            expected = direct[text].hosts
        else:
            via = rewritten[oracle[text]]
            assert not via.refused and all(h.endswith("0") for h in via.hosts), (text, via)
            expected = [h[:-1] for h in via.hosts]
        assert expand_hostlist(text) == expected, text


def test_generated_invalid_lists_are_refused(scontrol: Run) -> None:
    rng = random.Random(SEED + 2)
    texts = [invalid_hostlist(rng) for _ in range(trials(150, 5_000))]
    results = scontrol(texts)
    for text in texts:
        with pytest.raises(ValueError):
            expand_hostlist(text)
        # Slurm refuses too, or logs an error and prints what is left, or prints a name
        # that still has a bracket in it.
        assert results[text].refused or bracketed(results[text].hosts), (text, results[text])


@pytest.mark.parametrize(
    "text",
    [
        "n[3-1]",
        "n[010-1]",
        "n[]",
        "n[,]",
        "n[1,]",
        "n[,1]",
        "n[-]",
        "n[-1]",
        "n[1--3]",
        "n[1-3-5]",
        "n[a-c]",
        "n[1x]",
        "n[0x1]",
        "n[1-3 ]",
        "n[[1-2]]",
        "n[1-2]]",
        "n[1-2]][3]",
        "a[x]b[1-2]c[3]",
        "a[1-2]b[x]c[3]",
        "n[1-65537]",
        "a[1-65536,1]b[1]",
        "n1-3]",
        "a]b[1,2]",
        "x[y[1-2]z[3]",
        "n[1-2]x]",
        "n[x[1-2]",
        "n]x[1-2]",
    ],
)
def test_hand_picked_invalid_lists(scontrol: Run, text: str) -> None:
    result = scontrol([text])[text]
    with pytest.raises(ValueError):
        expand_hostlist(text)
    assert result.refused or bracketed(result.hosts), result


@pytest.mark.parametrize("text", ["n[1-3", "[1-3", "n[1-2,3", "n[1-2]x[3", "n[1-2]["])
def test_unclosed_bracket(scontrol: Run, text: str) -> None:
    # 23.11+ refuses; 22.05 "repairs" it into a different name ("n[1-3" -> "n]", "[1-3" -> "1-3").
    result = scontrol([text])[text]
    with pytest.raises(ValueError, match="without its ']'"):
        expand_hostlist(text)
    assert result.refused or result.hosts != [text]


def test_random_junk_agrees_with_scontrol(scontrol: Run) -> None:
    rng = random.Random(SEED + 3)
    # Junk with text right after a ']' is a suffix: 23.11+ semantics, tested above.
    texts = [t for t in (junk(rng) for _ in range(trials(600, 20_000))) if not re.search(r"\][^\], \[]", t)]
    results = scontrol(texts)
    for text in texts:
        assert_agrees(text, results[text])
    assert len(texts) > trials(300, 10_000)


def assert_agrees(text: str, theirs: Scontrol) -> None:
    """expand_hostlist gives scontrol's hosts, or refuses what scontrol refuses (or would leave
    brackets in); the other refusals, on purpose: an unclosed '[', which 22.05 "repairs", and a
    number past 64 bits, which Slurm clamps into another host's name."""
    ours = expand_or_none(text)
    if theirs.refused or bracketed(theirs.hosts):
        assert ours is None, (text, ours, theirs)
    elif ours is None:
        with pytest.raises(ValueError, match="without its ']'|does not fit in 64 bits"):
            expand_hostlist(text)
    else:
        assert ours == theirs.hosts, (text, theirs)


# Hypothesis draws hostlists from pieces of real ones: names, brackets, ranges, separators.
PIECES = st.sampled_from(
    ["n", "gpu", "-", "0", "1", "7", "01", "10", "[", "]", ",", " ", "x", "ib", "[1-3]", "[01-02,5]", "9" * 20]
)


def test_hypothesis_hostlists_agree_with_scontrol(scontrol: Run) -> None:
    seen: list[str] = []

    @settings(
        max_examples=trials(300, 5_000), deadline=None, derandomize=not SOAK, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip
    @given(st.lists(PIECES, min_size=1, max_size=12).map("".join))
    def check(text: str) -> None:
        if re.search(r"\][^\], \[]", text):  # a suffix: 23.11+ semantics, tested above
            return
        seen.append(text)
        assert_agrees(text, scontrol([text])[text])

    check()
    print(f"{len(seen)} Hypothesis hostlists agree with scontrol")
    assert len(seen) > trials(300, 5_000) // 3


def test_10k_hosts_match_scontrol(scontrol: Run) -> None:
    texts = [
        "gpu[00001-10000]",
        "n[" + ",".join(str(i) for i in range(0, 20_000, 2)) + "]",
        ",".join(f"r{i:03d}n[01-10]" for i in range(1000)),
        ",".join(f"node{i}" for i in range(10_000)),
    ]
    results = scontrol(texts)
    for text in texts:
        assert len(results[text].hosts) == 10_000
        assert expand_hostlist(text) == results[text].hosts
