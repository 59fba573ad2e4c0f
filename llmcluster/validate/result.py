"""What every check returns: a status, the reason, the rows it shows, and the numbers it measured.

A check is a list of items ("driver version", "bf16 8192x8192x8192", "all_reduce 64 MiB"), each with its
own PASS/WARN/FAIL/SKIP and a one-line detail; the check's status is the worst of its items, except that a
check whose items all SKIP is SKIP (nothing to judge is not a pass). `data` holds the raw measurements
for the JSON report. No torch here: the CLI and the `stack` check import this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
_SEVERITY = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}
STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def worst(statuses) -> str:
    statuses = list(statuses)
    if not statuses or all(s == SKIP for s in statuses):
        return SKIP
    return max(statuses, key=_SEVERITY.__getitem__)


def grade(ratio: float, pass_at: float, warn_at: float) -> str:
    """PASS at or above pass_at (a fraction of the expected value), WARN at or above warn_at, else FAIL."""
    return PASS if ratio >= pass_at else WARN if ratio >= warn_at else FAIL


@dataclass
class Item:
    name: str
    status: str
    value: str = ""      # what was measured, formatted ("712 TFLOP/s", "550.54.15")
    detail: str = ""     # why this status: the expectation, the threshold, or why it was skipped


@dataclass
class CheckResult:
    check: str
    items: list[Item] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)   # raw measurements for the JSON report
    node: str = ""        # "host" or "host:local_rank" in a multi-rank run

    def add(self, name: str, status: str, value: str = "", detail: str = "") -> Item:
        item = Item(name, status, value, detail)
        self.items.append(item)
        return item

    @property
    def status(self) -> str:
        return worst(i.status for i in self.items)

    @property
    def reason(self) -> str:
        """The one line that explains the status: the first item that has the check's status."""
        for i in self.items:
            if i.status == self.status:
                return f"{i.name}: {i.detail or i.value}".strip(": ")
        return "nothing to check"

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "node": self.node, "status": self.status, "reason": self.reason,
                "items": [asdict(i) for i in self.items], "data": self.data}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        return cls(d["check"], [Item(**i) for i in d["items"]], d.get("data", {}), d.get("node", ""))


def skipped(check: str, reason: str) -> CheckResult:
    r = CheckResult(check)
    r.add(check, SKIP, detail=reason)
    return r


def fmt_rate(x: float, unit: str) -> str:
    """12345.6 GB/s -> '12346 GB/s', 0.0123 -> '0.0123 GB/s' (3 significant digits at least)."""
    if x >= 100:
        return f"{x:,.0f} {unit}"
    if x >= 1:
        return f"{x:.2f} {unit}"
    return f"{x:.3g} {unit}"


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"
