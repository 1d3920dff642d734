"""Jaxpod's names for its Ray objects, and the sweep that frees a dead coordinator's.

**Names.** Every placement group and host-worker actor a coordinator creates is named
``jaxpod:<instance>:<allocation>:<part>`` in the Ray namespace ``jaxpod``
(:data:`~jaxpod.service.capacity.resolvers.ray.RAY_NAMESPACE`), where ``<instance>`` is minted
once per process (:func:`instance_id`): one per coordinator run. For example
``jaxpod:3f9c2a7d1e0b:5be0c41a9d22:slice-0`` (the hosts of slice 0),
``...:head-sim-0-v4-16`` (the reservation of a slice's head) and
``...:host-1:0c9e2f`` (host worker 1, with a per-launch suffix, since a restarted
group starts new actors while Ray may still hold the old names).

**What Ray frees by itself.** None of these objects is detached, so Ray fate-shares
them with the driver that made them: when a driver's connection to its raylet drops
(SIGKILL included) the raylet marks its job finished, and the GCS's job-finished
listener kills the job's non-detached actors and removes its placement groups
(``NodeManager::DisconnectClient`` -> ``Jobs().AsyncMarkFinished``;
``GcsPlacementGroupManager::CleanPlacementGroupIfNeededWhenJobDead``). Measured on
the local cluster with Ray 2.60: a ``jaxpod serve`` that joined by ``RAY_ADDRESS``
and held a v4-8 had its host worker ``DEAD`` and both placement groups ``REMOVED``
0.04 s after its SIGKILL. When the driver's whole node dies instead, the GCS marks its
jobs finished once its health checks declare the node dead
(``GcsJobManager::OnNodeDead``), some seconds later; until then the objects belong to
a live job and the sweep leaves them to Ray.

So :func:`sweep_orphans`, run when a coordinator starts, normally finds nothing. It
is the backstop for what that path misses (an object made detached, a job the GCS
marked dead while its objects were still being torn down): it releases jaxpod objects
of *other* instances whose creating job Ray reports dead, and never touches one whose
job is alive (another coordinator sharing the cluster) or unknown.

The objects are read from the GCS's own tables, which ``ray.util.state`` serves
through the dashboard; the local cluster runs no dashboard, and the sweep must not
need one.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from jaxpod import settings
from jaxpod.service.capacity.resolvers.ray import RAY_NAMESPACE
from jaxpod.timeouts import wait_for

logger = logging.getLogger(__name__)

#: Every jaxpod placement group and actor name starts with this.
NAME_PREFIX = "jaxpod:"
#: How long the sweep waits for Ray to show what it released as gone.
SWEEP_TIMEOUT = settings.ORPHAN_SWEEP_TIMEOUT

PLACEMENT_GROUP = "placement group"
ACTOR = "actor"

_lock = threading.Lock()
_instance: str | None = None


def instance_id() -> str:
    """This process's coordinator instance id (12 hex digits), minted on first use."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = uuid.uuid4().hex[:12]
        return _instance


def object_name(allocation_id: str, part: str) -> str:
    """``jaxpod:<instance>:<allocation_id>:<part>``: the Ray name of one of our objects."""
    return f"{NAME_PREFIX}{instance_id()}:{allocation_id}:{part}"


def instance_of(name: str) -> str | None:
    """The coordinator instance a jaxpod object name names; ``None`` for other names."""
    if not name.startswith(NAME_PREFIX):
        return None
    fields = name.split(":")
    if len(fields) < 4 or not fields[1]:
        return None
    return fields[1]


@dataclass(frozen=True)
class Orphan:
    """A jaxpod object of a coordinator whose Ray job is dead.

    Attributes:
      kind: :data:`PLACEMENT_GROUP` or :data:`ACTOR`.
      name: its Ray name.
      object_id: its Ray id (hex).
      instance: the coordinator instance that made it.
      job_id: the Ray job that made it (hex), which Ray reports dead.
      state: its Ray state when found (e.g. ``CREATED``, ``ALIVE``).
    """

    kind: str
    name: str
    object_id: str
    instance: str
    job_id: str
    state: str


@dataclass(frozen=True)
class SweepReport:
    """What :func:`sweep_orphans` did.

    Attributes:
      released: the orphans it killed or removed.
      live: jaxpod objects of other instances whose job is alive, left alone.
      gone: whether Ray showed every released object dead or removed in time.
    """

    released: tuple[Orphan, ...]
    live: int
    gone: bool = True


def find_orphans(own_instance: str | None = None) -> tuple[list[Orphan], int]:
    """Jaxpod objects of other instances whose creating job Ray reports dead.

    Args:
      own_instance: the instance whose objects are never orphans
        (:func:`instance_id` when ``None``).

    Returns:
      The orphans (not yet dead or removed), and how many objects of other instances
      were skipped because their job is alive or unknown to Ray.

    Raises:
      RuntimeError: this process is not connected to Ray.
    """
    if not ray.is_initialized():
        raise RuntimeError(
            "find_orphans: this process is not connected to Ray, so it cannot read the "
            "cluster's jobs, actors and placement groups. Fix: connect first "
            "(jaxpod.service.capacity.resolvers.ray.connect(address)).")
    own = own_instance or instance_id()
    tables = _GcsTables.read()
    orphans: list[Orphan] = []
    live = 0
    for entry in tables.ours():
        if entry.instance == own:
            continue
        if tables.job_dead.get(entry.job_id) is True:
            orphans.append(entry)
        else:  # alive, or not in the job table: never guess
            live += 1
    return orphans, live


def sweep_orphans(timeout_s: float | None = None) -> SweepReport:
    """Releases what dead coordinators left on the cluster; call once at start-up.

    Kills the host-worker actors and removes the placement groups of other jaxpod
    instances whose Ray job is dead, logs each one, then waits until Ray shows them
    gone. Ray normally frees them itself when their driver dies (see the module
    docstring), so this usually finds nothing; it never touches objects of a live job.

    Args:
      timeout_s: how long to wait for Ray to show them gone
        (``JAXPOD_ORPHAN_SWEEP_TIMEOUT_S``); on time-out a warning is logged.

    Returns:
      What was released and what was left alone.
    """
    limit = SWEEP_TIMEOUT.resolve(timeout_s)
    orphans, live = find_orphans()
    for orphan in orphans:
        _release(orphan)
        logger.info("released %s %s (%s) of dead coordinator %s (Ray job %s, was %s)",
                    orphan.kind, orphan.name, orphan.object_id, orphan.instance,
                    orphan.job_id, orphan.state)
    gone = True
    if orphans:
        ids = {o.object_id for o in orphans}
        gone = bool(wait_for(lambda: not ids & _GcsTables.read().present_ids(), limit,
                             max_poll_s=0.1))
        if not gone:
            logger.warning("Released %d orphaned object(s), but Ray did not show all of "
                           "them gone within %.1f s (%s).", len(orphans), limit,
                           SWEEP_TIMEOUT.env_var)
    logger.info("orphan sweep: released %d object(s) of dead coordinators; left %d of "
                "live ones alone", len(orphans), live)
    return SweepReport(tuple(orphans), live, gone)


def _release(orphan: Orphan) -> None:
    """Kills or removes one orphan; one already gone is fine."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        if orphan.kind == ACTOR:
            ray.kill(ray.get_actor(orphan.name, namespace=RAY_NAMESPACE), no_restart=True)
        else:
            group_id = ray.PlacementGroupID(bytes.fromhex(orphan.object_id))
            remove_placement_group(PlacementGroup(group_id))
    except ValueError:  # get_actor: no such live actor any more
        logger.debug("%s %s was already gone", orphan.kind, orphan.name)
    except Exception:  # removed meanwhile (Ray's own clean-up races with ours)
        logger.debug("releasing %s %s failed", orphan.kind, orphan.name, exc_info=True)


@dataclass(frozen=True)
class _GcsTables:
    """The GCS's job, actor and placement-group tables at one moment."""

    job_dead: dict[str, bool]
    actors: Sequence[Any]
    groups: Sequence[Any]

    @classmethod
    def read(cls) -> _GcsTables:
        from ray._private.state import state

        gcs_pb2 = _gcs_pb2()
        accessor = state._connect_and_get_accessor()
        jobs = (gcs_pb2.JobTableData.FromString(raw) for raw in accessor.get_job_table(
            skip_submission_job_info_field=True, skip_is_running_tasks_field=True))
        return cls(
            job_dead={j.job_id.hex(): bool(j.is_dead) for j in jobs},
            actors=[gcs_pb2.ActorTableData.FromString(raw)
                    for raw in accessor.get_actor_table(None, None)],
            groups=[gcs_pb2.PlacementGroupTableData.FromString(raw)
                    for raw in accessor.get_placement_group_table()],
        )

    def ours(self) -> Iterable[Orphan]:
        """Every jaxpod object still present (actors not ``DEAD``, groups not
        ``REMOVED``), as an :class:`Orphan` candidate."""
        gcs_pb2 = _gcs_pb2()
        actor_state = gcs_pb2.ActorTableData.ActorState
        group_state = gcs_pb2.PlacementGroupTableData.PlacementGroupState
        for a in self.actors:
            instance = instance_of(a.name)
            if (instance and a.ray_namespace == RAY_NAMESPACE
                    and a.state != actor_state.Value("DEAD")):
                yield Orphan(ACTOR, a.name, a.actor_id.hex(), instance, a.job_id.hex(),
                             actor_state.Name(a.state))
        for g in self.groups:
            instance = instance_of(g.name)
            if (instance and g.ray_namespace == RAY_NAMESPACE
                    and g.state != group_state.Value("REMOVED")):
                yield Orphan(PLACEMENT_GROUP, g.name, g.placement_group_id.hex(), instance,
                             g.creator_job_id.hex(), group_state.Name(g.state))

    def present_ids(self) -> set[str]:
        """Ids of the jaxpod objects not yet dead or removed."""
        return {o.object_id for o in self.ours()}


def _gcs_pb2() -> Any:
    """Ray's generated GCS protobuf module (it ships without type stubs)."""
    import importlib

    return importlib.import_module("ray.core.generated.gcs_pb2")
