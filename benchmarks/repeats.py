"""One script's repeated runs as one entry: every figure the median of the runs, with
its min-max beside it, and every target judged again on its median.

``run_all.py`` runs each script ``--repeats`` times (5 in a full run), in rounds (every
script once, then again), so a busy spell of the machine falls on several scripts'
single runs rather than on all of one script's. A figure that moves ±20 % between runs
on this 2-core machine is shown with that spread instead of as one number.
"""

from __future__ import annotations

import operator
import statistics
from collections.abc import Callable, Sequence
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
    "==": operator.eq}


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _median(values: Sequence[Any]) -> Any:
    """The median of numbers (an int stays an int when the runs agree on ints), the
    element-wise median of equal-length lists of numbers, else the first run's."""
    if all(is_number(v) for v in values):
        middle = statistics.median(values)
        return int(middle) if all(isinstance(v, int) for v in values) and \
            middle == int(middle) else middle
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1 \
            and all(is_number(x) for v in values for x in v):
        return [statistics.median(column) for column in zip(*values, strict=True)]
    return values[0]


def _spread(values: Sequence[Any]) -> list[float] | None:
    """``[min, max]`` of numbers that differ between runs; ``None`` otherwise."""
    if len(values) < 2 or not all(is_number(v) for v in values):
        return None
    low, high = min(values), max(values)
    return None if low == high else [low, high]


def judge(value: float, target: str) -> bool:
    """Whether ``value`` meets ``target`` (``"<= 1.05"``, ``">= 0.9"``, ...)."""
    op, bound = target.split()
    return _OPS[op](value, float(bound))


def combine(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The entry of ``runs`` (``run_all.run_script``'s entries of one script, oldest
    first): a failed run makes the whole entry failed (its error shown); else figures
    and targets are medians, ``spread`` holds each varying figure's and target's
    ``[min, max]``, and a target is met when its median meets it; an exact one
    (``"== 0"``: corrupt checkpoints, steps lost) only when every run met it, its value
    the run furthest from it."""
    first = runs[0]
    entry: dict[str, Any] = {
        "command": first["command"], "ran_at": first["ran_at"], "repeats": len(runs),
        "seconds": round(statistics.median(r["seconds"] for r in runs), 1),
        "exit": next((r["exit"] for r in runs if r["exit"] != 0), 0),
        "log": first.get("log")}
    failed = [r for r in runs if "error" in r]
    if failed:
        entry["error"] = failed[0]["error"]
        entry["failed_runs"] = len(failed)
        return entry
    figures: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for name in first["figures"]:
        values = [r["figures"][name] for r in runs if name in r["figures"]]
        figures[name] = _median(values)
        if (low_high := _spread(values)) is not None:
            spread[name] = low_high
    targets: dict[str, Any] = {}
    for name, t in first["targets"].items():
        values = [r["targets"][name]["value"] for r in runs if name in r["targets"]]
        op, bound = t["target"].split()
        if op == "==":  # a count that must be exact (0 mismatches): every run, the worst
            value = max(values, key=lambda v: abs(v - float(bound)))
            met = all(r["targets"][name]["met"] for r in runs if name in r["targets"])
        else:
            value = _median(values)
            met = judge(value, t["target"])
        targets[name] = {**t, "value": value, "met": met}
        if (low_high := _spread(values)) is not None:
            spread[f"target:{name}"] = low_high
    entry.update(figures=figures, targets=targets, spread=spread)
    return entry
