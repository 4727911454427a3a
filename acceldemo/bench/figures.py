"""The benchmark's records (a spread of runs, one reported figure with its target) and interleaved timing."""
from __future__ import annotations

import operator
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

_COMPARE = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


@dataclass(frozen=True)
class Spread:
    """Several runs of one quantity: the median and the range, so noise is visible beside the value."""

    median: float
    low: float
    high: float
    runs: int

    @staticmethod
    def of(values: Iterable[float]) -> Spread:
        values = [float(v) for v in values]
        if not values:
            raise ValueError("a spread needs at least one run")
        return Spread(statistics.median(values), min(values), max(values), len(values))

    def __str__(self) -> str:
        if self.runs == 1:
            return f"{_number(self.median)} (1 run)"
        return f"{_number(self.median)} ({_number(self.low)}–{_number(self.high)})"


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


@dataclass(frozen=True)
class Target:
    """What a figure should be: `op` is <=, >= or ==, compared with the median."""

    op: str
    bound: float

    def met_by(self, value: float) -> bool:
        return _COMPARE[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {_number(self.bound)}"


@dataclass
class Figure:
    """One line of the report. `value` is None when the figure could not be measured; `note` then says why."""

    key: str
    section: int
    title: str
    unit: str  # "ratio", "graphs", "requests/s", "errors", ...
    value: Spread | None
    target: Target | None = None
    note: str = ""
    detail: dict = field(default_factory=dict)
    if_missed: str = ""  # why the target is missed, and what would close it (shown only when it is)

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        return self.target.met_by(self.value.median)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["target"] = str(self.target) if self.target else None
        data["met"] = self.met
        return data

    @staticmethod
    def from_dict(data: dict) -> Figure:
        """A figure back from `as_dict` (one measured in a child process)."""
        target = data.get("target")
        op, _, bound = target.partition(" ") if target else ("", "", "")
        return Figure(data["key"], data["section"], data["title"], data["unit"],
                      Spread(**data["value"]) if data.get("value") else None,
                      Target(op, float(bound)) if target else None, data.get("note", ""), data.get("detail", {}),
                      data.get("if_missed", ""))


def ratios(numerators: Iterable[float], denominators: Iterable[float]) -> Spread:
    """Run-by-run ratios of interleaved measurements: drift of the machine cancels within each pair."""
    return Spread.of(a / b for a, b in zip(numerators, denominators, strict=True))


def interleaved(calls: list[Callable[[], float]], runs: int) -> list[list[float]]:
    """`runs` timings of each call, alternating forward and backward order so drift and order effects cancel."""
    timings: list[list[float]] = [[] for _ in calls]
    for i in range(runs):
        order = range(len(calls)) if i % 2 == 0 else reversed(range(len(calls)))
        for j in order:
            timings[j].append(calls[j]())
    return timings


def log(message: str) -> None:
    """A bench's progress line, on stderr (its figures go to stdout)."""
    print(message, file=sys.stderr, flush=True)
