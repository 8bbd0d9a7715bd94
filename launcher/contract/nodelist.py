"""Node lists as a person reads them: Slurm's compressed form (`n[1-3,5]`), the one form meshrun prints.

Slurm prints its node lists so (SLURM_JOB_NODELIST, squeue, sacct); meshrun's own lists (the nodes a start ran
on, the suspects left out, the nodes a check failed on) are written the same way, so the batch log, `status`
and `meshrun nodes` never show one list as `n[1-2]` and another as `n1,n2`. Stdlib-only, for both sides
(meshrun.launcher.rank.hostlist expands; submit may not import it).
"""

from __future__ import annotations

import re
from itertools import groupby
from typing import Iterable

_NUMBERED = re.compile(r"(.*?)([0-9]+)")


def compress(names: Iterable[str]) -> str:
    """['n3', 'n1', 'n2', 'gpu07'] -> 'gpu07,n[1-3]': as `scontrol show hostlist` (sorted, each name once;
    zero-padded numbers group with their own width; a name without a number as it is)."""
    found: list[tuple[str, str]] = []  # prefix, digits
    plain: set[str] = set()
    for name in names:
        match = _NUMBERED.fullmatch(name)
        if match:
            found.append((match.group(1), match.group(2)))
        elif name:
            plain.add(name)
    # A zero-padded number (07) keeps its width, and one as wide (10) joins it; others need none (9 and 10 group).
    padded = {(prefix, len(digits)) for prefix, digits in found if len(digits) > 1 and digits[0] == "0"}
    numbered = [(p, len(d) if (p, len(d)) in padded else 0, int(d)) for p, d in found]  # prefix, width, number
    groups = [_group(prefix, width, [n for _, _, n in hosts]) for (prefix, width), hosts in _by_prefix(numbered)]
    return ",".join(sorted([*plain, *groups]))


def normalized(text: str) -> str:
    """A list written either way ('n1,n3', 'n[1-2]') in the compressed form; one with brackets as it is."""
    if not text or "[" in text:
        return text
    return compress(part.strip() for part in text.split(","))


def _by_prefix(numbered: list[tuple[str, int, int]]) -> Iterable[tuple[tuple[str, int], list[tuple[str, int, int]]]]:
    ordered = sorted(set(numbered))
    return ((key, list(hosts)) for key, hosts in groupby(ordered, key=lambda h: (h[0], h[1])))


def _group(prefix: str, width: int, numbers: list[int]) -> str:
    if len(numbers) == 1:
        return f"{prefix}{numbers[0]:0{width}d}"
    runs: list[list[int]] = []
    for number in numbers:  # sorted, distinct
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    parts = (f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}" for lo, hi in runs)
    return f"{prefix}[{','.join(parts)}]"
