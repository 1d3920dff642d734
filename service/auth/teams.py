"""Teams sharing one reservation: each ``[[team]]`` of the tokens file, its weight and
the slices it is guaranteed. A token names its team (``team = "T"``); a token naming
none is in :data:`DEFAULT_TEAM`. The job scheduler
(:mod:`jaxpod.service.jobs.fair_share`) shares contended slices by these weights."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The team of a job whose owner's token names none.
DEFAULT_TEAM = "default"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


@dataclass(frozen=True)
class Team:
    """A ``[[team]]`` of the tokens file.

    Attributes:
      name: what tokens name in their ``team``.
      weight: its share of contended slices, relative to the other teams' weights.
      guaranteed: slices per accelerator type it may reclaim whatever its share.
    """

    name: str
    weight: float = 1.0
    guaranteed: Mapping[str, int] = field(default_factory=dict)


def parse_team(label: str, table: Any) -> Team:
    """One ``[[team]]`` table, checked.

    Raises:
      ValueError: a key, name, weight or guarantee is wrong; the message says which
        and what is expected (prefixed by ``label``).
    """
    def wrong(problem: str) -> ValueError:
        return ValueError(f"{label}: {problem}")

    if not isinstance(table, dict):
        raise wrong("is not a table.")
    unknown = sorted(set(table) - {"name", "weight", "guaranteed"})
    if unknown:
        raise wrong(f"unknown key {unknown[0]!r}; the keys are name, weight and "
                    "guaranteed.")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise wrong(f"name {name!r} must be 1-64 letters, digits or ._@- characters.")
    weight = table.get("weight", 1)
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
            or not math.isfinite(weight) or weight <= 0):
        raise wrong(f"weight of team {name!r} must be a number > 0; got {weight!r}.")
    guaranteed = table.get("guaranteed", {})
    if not isinstance(guaranteed, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in guaranteed.items()):
        raise wrong(f"guaranteed of team {name!r} must map accelerator types to slice "
                    f"counts >= 0 (guaranteed = {{ \"v4-16\" = 1 }}); got {guaranteed!r}.")
    return Team(name, float(weight), {k.strip().lower(): v for k, v in guaranteed.items()})
