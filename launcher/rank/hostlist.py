"""Slurm hostlist expansion in pure Python, equal to `scontrol show hostnames`.

Torch-free and stdlib-only; `meshrun.launcher.rank.env.expand_hostlist` re-exports it.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, Iterator

# ---- Slurm hostlists ----------------------------------------------------------------------
# A port of Slurm's src/common/hostlist.c (_next_tok, _parse_single_range, _push_range_list,
# _hostlist_create_bracketed) as of Slurm 23.11+, where a suffix may follow the last bracket
# ("n[1-2]-ib") and an unclosed '[' is an error; 22.05 rejected the first and mangled the
# second into a name ending in "]". Quirks are kept where they change no sane input: widths
# come from the low bound's text ("n[1-010]" -> n1..n10, "n[ 1-3]" -> n01..n03), and groups
# before the last bracket nest right to left ("a[1-2]b[3-4]c[5]": a1b3c5 a2b3c5 a1b4c5 ...).
# Stricter than Slurm on purpose (it logs, mangles or drops where we raise): a name that would
# keep a '[' or ']', control characters, numbers past Slurm's 64-bit counters, a bad bracket
# group far from the last one (Slurm logs it, drops those hosts and goes on), and more than
# _MAX_HOSTS hosts in all.

_SEPARATOR = re.compile(r"[\t\n ,]")
_SEPARATORS = re.compile(r"[\t\n ,]*")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_PLAIN_LIST = re.compile(r"[0-9]{1,19}(?:-[0-9]{1,19})?(?:,[0-9]{1,19}(?:-[0-9]{1,19})?)*")
_STRTOUL = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")  # C strtoul, base 10
_ULONG = 2**64
_MAX_RANGE = 64 * 1024  # hosts in one lo-hi range (Slurm's MAX_RANGE)
_MAX_RANGES = 64 * 1024  # comma-separated items in one bracket (22.05: fatal() beyond)
_MAX_PREFIX_CNT = 64 * 1024  # hosts in one bracket group before the last (MAX_PREFIX_CNT)
_MAX_HOSTS = 1 << 20  # ours: no cluster has a million nodes; stops a[1-9999]b[1-9999]

_Range = tuple[int, int, int]  # lo, hi, zero-padded width


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist ("n[01-03,7],gpu[1-2]-ib") as `scontrol show hostnames` does."""
    if _CONTROL.search(text):
        raise ValueError(f"hostlist {text!r} contains a control character")
    hosts: list[str] = []
    try:
        for token in _tokens(text):
            if "[" in token or "]" in token or len(token) >= 20:
                hosts.extend(_expand_token(token, _MAX_HOSTS - len(hosts)))
            else:  # a plain name, too short for its number to overflow: as is (the fast path)
                hosts.append(token)
    except ValueError as e:
        raise ValueError(f"invalid hostlist {text!r}: {e}") from None
    if len(hosts) > _MAX_HOSTS:
        raise ValueError(f"hostlist {text[:80]!r}... names more than {_MAX_HOSTS} hosts")
    return hosts


def _tokens(text: str) -> list[str]:
    """Split at separators that are not inside brackets (Slurm's _next_tok)."""
    if "[" not in text:  # the common long case, "n1,n2,...": no bracket can join tokens
        return [token for token in _SEPARATOR.split(text) if token]
    return list(_bracketed_tokens(text))


def _bracketed_tokens(text: str) -> Iterator[str]:
    # Like _next_tok, brackets are searched for from `parse` to the end of the whole string;
    # `parse` only moves forward, so each search's answer is reused until passed (linear time).
    next_open, next_close = _forward_finder(text, "["), _forward_finder(text, "]")
    pos = 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]  # "*" always matches
        if pos == len(text):
            return
        start = parse = pos
        end = _separator_at_or_after(text, pos)
        while True:
            open_at = next_open(parse)
            if open_at < 0 or open_at > end:
                break
            close_at = next_close(parse)
            if close_at < 0 or close_at < open_at:
                break
            if close_at < end:
                parse = close_at + 1
            else:  # a separator inside brackets: the token runs on past the ']'
                end = _separator_at_or_after(text, close_at)
        yield text[start:end]
        pos = end


def _forward_finder(text: str, char: str) -> Callable[[int], int]:
    found = -2  # not searched yet

    def find(start: int) -> int:
        nonlocal found
        if found == -2 or 0 <= found < start:
            found = text.find(char, start)
        return found

    return find


def _separator_at_or_after(text: str, pos: int) -> int:
    match = _SEPARATOR.search(text, pos)
    return match.start() if match else len(text)


def _expand_token(token: str, budget: int) -> list[str]:
    open_at = token.rfind("[")
    if open_at < 0:
        return [_bare_host(token)]
    close_at = token.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"{token!r} has a '[' without its ']'")
    # Slurm: text after the ']' is a suffix, unless it starts with ',' (then it is dropped).
    suffix = token[close_at + 1 :]
    suffix = "" if suffix.startswith(",") else suffix
    last = _parse_range_list(token[open_at + 1 : close_at])
    head, groups = _split_prefix(token[:open_at])
    for part in (head, suffix):
        if "[" in part or "]" in part:
            raise ValueError(f"{token!r} would give host names containing brackets")
    count = _count(last)
    for ranges, _ in groups:
        count *= _count(ranges)
    if count > budget:
        raise ValueError(f"more than {_MAX_HOSTS} hosts")
    return _combine(head, groups, _numbers(last), suffix)


def _bare_host(token: str) -> str:
    if "]" in token:
        raise ValueError(f"{token!r} has a ']' without its '['")
    digits = len(token) - len(token.rstrip("0123456789"))
    if digits >= 20 and int(token[-digits:]) >= _ULONG:  # Slurm would print a clamped number
        raise ValueError(f"{token!r}: its number does not fit in 64 bits")
    return token


def _split_prefix(prefix: str) -> tuple[str, list[tuple[list[_Range], str]]]:
    """Bracket groups before the last bracket, rightmost first, each with the text after it.

    Slurm's _push_range_list recursion: the last '[' and the last ']' after it delimit a group.
    """
    groups = []
    while (open_at := prefix.rfind("[")) >= 0 and (close_at := prefix.rfind("]", open_at)) >= 0:
        inside = prefix[open_at + 1 : close_at]
        ranges = _parse_range_list(inside)
        if _count(ranges) > _MAX_PREFIX_CNT:
            raise ValueError(f"more than {_MAX_PREFIX_CNT} hosts in [{inside}]")
        groups.append((ranges, prefix[close_at + 1 :]))
        prefix = prefix[:open_at]
    return prefix, groups


def _combine(head: str, groups: list[tuple[list[_Range], str]], last: list[str], suffix: str) -> list[str]:
    # Slurm loops over the rightmost group outermost, then leftwards; the last bracket is
    # innermost. product() varies its first argument slowest, so pass groups as parsed.
    if not groups:
        return [head + num + suffix for num in last]
    tails = [tail for _, tail in reversed(groups)]
    hosts = []
    for picked in itertools.product(*(_numbers(ranges) for ranges, _ in groups)):
        stem = head + "".join(num + tail for num, tail in zip(reversed(picked), tails))
        hosts.extend([stem + num + suffix for num in last])
    return hosts


def _count(ranges: list[_Range]) -> int:
    return sum(hi - lo + 1 for lo, hi, _ in ranges)


def _numbers(ranges: list[_Range]) -> list[str]:
    numbers: list[str] = []
    for lo, hi, width in ranges:
        if lo == hi:  # fragmented allocations, "n[1,4,9,...]", are mostly single numbers
            numbers.append(str(lo).zfill(width))
        elif width <= len(str(lo)):  # none needs padding: plain str() is 3x faster
            numbers.extend(map(str, range(lo, hi + 1)))
        else:
            numbers.extend([str(n).zfill(width) for n in range(lo, hi + 1)])
    return numbers


def _parse_range_list(text: str) -> list[_Range]:
    items = text.split(",")
    if len(items) > _MAX_RANGES:
        raise ValueError(f"more than {_MAX_RANGES} items in one bracket")
    if _PLAIN_LIST.fullmatch(text):  # what Slurm itself writes; the general path is 5x slower
        return [_plain_range(item) for item in items]
    return [_parse_range(item) for item in items]


def _plain_range(item: str) -> _Range:
    low, _, high = item.partition("-")
    return _checked_range(item, int(low), int(high or low), len(low))


def _parse_range(item: str) -> _Range:
    """ "lo" or "lo-hi" (Slurm's _parse_single_range, strtoul quirks included)."""
    bad = ValueError(f"invalid range {item!r}")
    dash = item.find("-")
    low, high = (item, "") if dash < 0 else (item[:dash], item[dash + 1 :])
    if "x" in item or high.startswith("-"):  # 'x' is a multi-dimensional box, never ours
        raise bad
    lo, lo_end = _strtoul(low, bad)
    if high:  # as in C, junk after the low bound goes unnoticed once a high bound is parsed
        hi, hi_end = _strtoul(high, bad)
        if hi_end != len(high):
            raise bad
    elif lo_end != len(low):
        raise bad
    else:
        hi = lo
    return _checked_range(item, lo, hi, len(low.encode()))  # width is strlen(): bytes


def _checked_range(item: str, lo: int, hi: int, width: int) -> _Range:
    if lo > hi:
        raise ValueError(f"descending range {item!r}")
    if hi - lo + 1 > _MAX_RANGE:
        raise ValueError(f"more than {_MAX_RANGE} hosts in range {item!r}")
    if hi >= _ULONG - 1:  # Slurm's empty-range sentinel: it prints nothing or loops
        raise ValueError(f"range {item!r} does not fit in 64 bits")
    return lo, hi, width


def _strtoul(text: str, bad: ValueError) -> tuple[int, int]:
    """C strtoul(text, &end, 10): (value, end); `bad` when no digits were read."""
    match = _STRTOUL.match(text)
    if not match:
        raise bad
    value = int(match[2])
    if value >= _ULONG:
        raise ValueError(f"{text!r} does not fit in 64 bits")
    return (-value % _ULONG if match[1] == "-" else value), match.end()
