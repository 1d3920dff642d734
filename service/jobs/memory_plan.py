"""Which in-memory checkpoint a resumed attempt restores, from what the hosts' nodes
hold (:mod:`jaxpod.worker.memory_checkpoints` keeps them).

Only small facts pass through the coordinator: for each node, the steps it holds and
whose shards (its host's own, its peer's copy), with those hosts' input positions. The
shards themselves go from node to device, or from the peer's devices to the host's, in
the restore's own collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpod.jobs import JobSpec

#: The share of the steps' time the service lets in-memory checkpoints stall them when it
#: chooses their interval (``memory_checkpoint_every=None``).
STALL_SHARE = 0.02

#: What one node holds of a job: step -> {host whose shards they are: its input position}.
Holdings = Mapping[int, Mapping[int, Any]]


@dataclass(frozen=True)
class MemoryPlan:
    """Restore in-memory checkpoint ``step``: host ``g``'s shards from the node of host
    ``sources[g]``, and its input position ``positions[g]``."""

    step: int
    sources: tuple[int, ...]
    positions: tuple[Any, ...]

    @property
    def from_peers(self) -> int:
        """Hosts whose shards come from their peer's copy (their node was replaced)."""
        return sum(1 for g, holder in enumerate(self.sources) if holder != g)

    def describe(self) -> str:
        """How the history says it."""
        where = (f"{self.from_peers} host(s)' shards from their peer's copy"
                 if self.from_peers else "every host's shards on its own node")
        return f"the in-memory checkpoint at step {self.step} ({where})"


def plan(held: Sequence[Holdings], newer_than: int | None) -> MemoryPlan | None:
    """The newest step, after ``newer_than``, every host's shards of which some node
    holds, given each host's node's holdings in host order: each host's from its own
    node where it can, else from a node that sends no other host's (a node holds at most
    one copy, so the restore is one collective). ``None``: no such step."""
    hosts = len(held)
    for step in sorted({s for h in held for s in h}, reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        sources: list[int] = []
        positions: list[Any] = []
        sending: set[int] = set()
        for g in range(hosts):
            if g in held[g].get(step, {}):
                holder = g
            else:
                holders = [x for x in range(hosts)
                           if x not in sending and g in held[x].get(step, {})]
                if not holders:
                    break
                holder = holders[0]
                sending.add(holder)
            sources.append(holder)
            positions.append(held[holder][step][g])
        else:
            return MemoryPlan(step, tuple(sources), tuple(positions))
    return None


def memory_checkpoints_on(spec: JobSpec) -> bool:
    """Whether the job keeps in-memory checkpoints: asked for, or chosen by the service
    for a job with persistent ones."""
    every = spec.memory_checkpoint_every
    return bool(every) or (every is None and bool(spec.checkpoint_every))


def chosen_interval(spec: JobSpec, stall_s: float | None, step_s: float | None) -> int:
    """Steps between in-memory checkpoints (0: none): the job's own, or, chosen by the
    service, the fewest that keep their measured stall within :data:`STALL_SHARE` of the
    steps' time, at most ``checkpoint_every`` (a RAM copy is never rarer than a
    persistent one). Before one was measured: after every loop, to measure one."""
    if not memory_checkpoints_on(spec):
        return 0
    if spec.memory_checkpoint_every:
        return spec.memory_checkpoint_every
    most = spec.checkpoint_every or 1
    if stall_s is None or not step_s:
        return min(spec.steps_per_run, most)
    return max(1, min(most, math.ceil(stall_s / (STALL_SHARE * step_s))))
