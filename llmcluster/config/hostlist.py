"""Slurm hostlist syntax, in one place: 'gpu[01-03,07],login' <-> gpu01 gpu02 gpu03 gpu07 login.

Read by the cluster spec (`nodes.hosts`), `monitor config --slurm-nodelist` and the validate ranks' rendezvous
(the first host of $SLURM_JOB_NODELIST when `scontrol` is not on PATH).
"""

from __future__ import annotations

import re

from llmcluster.errors import UserError
from llmcluster.render import show_value

# RFC 1123 host names (labels of letters, digits and inner '-', joined by '.'; at most 253 characters) and the
# characters a hostlist expression may hold: a name goes into slurm.conf, topology.conf, the Ansible inventory
# and prometheus.yml, where a newline or a space would start a new directive.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_RE = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*", re.ASCII)
HOST_CHARS = "letters, digits, inner '-' and '.' (RFC 1123)"
HOSTLIST_RE = re.compile(r"[A-Za-z0-9.,\[\]-]+", re.ASCII)
_NUMBER = re.compile(r"[0-9]+", re.ASCII)   # a range bound ('٥'.isdigit() is True, and int() reads it)
MAX_HOSTS = 100_000     # a typo like gpu[1-99999999] is refused, not expanded into memory

_PART = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist syntax -> names: 'gpu[01-03,07],login' -> gpu01 gpu02 gpu03 gpu07 login.

    Zero padding follows the range's first bound, as Slurm does. One bracket per name, which is what
    Slurm itself prints for one-dimensional clusters (the only kind GPU clusters use)."""
    names: list[str] = []
    pos = 0
    expr = expr.strip()
    while pos < len(expr):
        m = _PART.match(expr, pos)
        if not m or m.end() == pos:
            raise UserError(f"cannot parse Slurm node list {show_value(expr)} near {show_value(expr[pos:])}")
        prefix, ranges, suffix = m.groups()
        if ranges is None:
            names.append(prefix + suffix)
        else:
            for item in ranges.split(","):
                lo, _, hi = item.partition("-")
                if not _NUMBER.fullmatch(lo) or (hi and not _NUMBER.fullmatch(hi)):
                    raise UserError(f"bad range {show_value(item)} in Slurm node list {show_value(expr)}")
                hi = hi or lo
                if int(hi) < int(lo):
                    raise UserError(f"descending range {show_value(item)} in Slurm node list {show_value(expr)}")
                width = len(lo)
                if len(names) + int(hi) - int(lo) + 1 > MAX_HOSTS:
                    raise UserError(f"Slurm node list {show_value(expr)} names more than {MAX_HOSTS} hosts")
                names.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
        pos = m.end()
        if pos < len(expr):
            if expr[pos] != ",":
                raise UserError(f"cannot parse Slurm node list {show_value(expr)} near {show_value(expr[pos:])}")
            pos += 1
    if not names:
        raise UserError("empty Slurm node list")
    return names


def compress_hostlist(names: list[str]) -> str:
    """The inverse, for `cluster init`: gpu01 gpu02 gpu03 gpu07 -> 'gpu[01-03,07]' (same prefix and width)."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for n in names:
        m = re.fullmatch(r"(.*?)([0-9]+)", n)
        if not m:
            plain.append(n)
            continue
        groups.setdefault((m.group(1), len(m.group(2))), []).append(int(m.group(2)))
    parts = []
    for (prefix, width), nums in groups.items():
        nums = sorted(set(nums))
        if len(nums) == 1:
            parts.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        runs, start, prev = [], nums[0], nums[0]
        for x in nums[1:] + [None]:
            if x is not None and x == prev + 1:
                prev = x
                continue
            runs.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if x is not None:
                start = prev = x
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts + plain)
