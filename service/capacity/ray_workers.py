"""Host workers as Ray actors, each pinned to its slice's placement-group bundle: how
:class:`~jaxpod.service.capacity.pools.RaySlices` starts a replica group's workers."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxpod.service.slices.replica_group import HostPlacement, not_answered
from jaxpod.worker.host_worker import HostWorker


class RayWorkers:
    """Host workers as Ray actors, each pinned to its placement-group bundle."""

    def start(self, placements: Sequence[HostPlacement], devices_per_host: int,
              platform: str) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from jaxpod.service.capacity.resolvers.ray import RAY_NAMESPACE

        actor_cls = ray.remote(HostWorker)
        # A restart launches while Ray may still hold the killed actors' names.
        suffix = uuid.uuid4().hex[:6]
        return [
            actor_cls.options(
                num_cpus=p.num_cpus, resources=p.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    p.placement_group, placement_group_bundle_index=p.bundle_index),
                **({"name": f"{p.name}:{suffix}", "namespace": RAY_NAMESPACE}
                   if p.name else {}),
            ).remote(i, len(placements), devices_per_host, platform, p.env, p.unset_env)
            for i, p in enumerate(placements)
        ]

    def call(self, workers: Sequence[Any], method: str, args: Sequence[tuple[Any, ...]],
             deadline: float, what: str, limit: float) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*a) for w, a in zip(workers, args, strict=True)]
        _, pending = ray.wait(refs, num_returns=len(refs),
                              timeout=max(0.0, deadline - time.monotonic()))
        if pending:
            raise not_answered([i for i, r in enumerate(refs) if r in pending],
                                len(refs), what, limit)
        return list(ray.get(refs))

    def stop(self, workers: Sequence[Any], limit: float) -> None:
        import ray

        refs = [w.shutdown.remote() for w in workers]
        ray.wait(refs, num_returns=len(refs), timeout=limit)
        self.kill(workers)

    def kill(self, workers: Sequence[Any]) -> None:
        if not workers:
            return
        import ray

        for w in workers:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(w)
