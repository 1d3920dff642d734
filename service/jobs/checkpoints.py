"""A job's checkpoints as the coordinator sees them: where the hosts write them, which
steps are committed, and a finished job's state read back for its result.

The hosts write every checkpoint themselves, with orbax
(:mod:`jaxpod.worker.checkpoints`), into ``<checkpoint dir>/<job id>/<step>/``, which
every host can reach (a ``gs://`` bucket on GKE, a shared folder on the simulated
cluster). The coordinator tells them when, records each step once they committed it,
and reads the directory through orbax to find committed steps (after its own restart,
or an attempt lost before it heard of a commit); a checkpoint's state never passes
through it, except when a client asks for a finished job's state, which it streams
in bounded blocks (:mod:`~jaxpod.service.jobs.state_reader`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxpod import settings, trees
from jaxpod.pieces import RowParts
from jaxpod.service.jobs.state_reader import StateReader
from jaxpod.storage import join
from jaxpod.trees import dtype_from_name
from jaxpod.worker.checkpoints import FORK_PINS, META, STATE, pinned_steps

logger = logging.getLogger(__name__)

#: Committed checkpoints kept per job (the hosts remove older ones as they commit).
KEEP = settings.JOB_CHECKPOINTS_KEPT


class JobCheckpoints:
    """One job's checkpoint directory, ``<root>/<job id>``.

    Args:
      root: the service's checkpoint dir (``--checkpoint-dir``).
      job_id: the job.
      fork_of: a fork's source job and the step of its checkpoint the fork starts
        from: read in place (never copied, never changed) until the fork commits its
        own.
    """

    def __init__(self, root: str, job_id: str, fork_of: tuple[str, int] | None = None
                 ) -> None:
        self.directory = join(root, job_id)
        self._base = (join(root, fork_of[0]), fork_of[1]) if fork_of is not None else None

    def directory_of(self, step: int) -> str:
        """The folder holding checkpoint ``step``: the job's own, or a fork's source's
        for the step it was forked from (when it has not written that step itself)."""
        if self._base is not None and step == self._base[1] and step not in set(
                self.committed_steps()):
            return self._base[0]
        return self.directory

    @property
    def keep(self) -> int:
        return int(KEEP.value())

    def state_path(self, step: int) -> str:
        """Where step ``step``'s state is: a plain orbax checkpoint
        (``StandardCheckpointer().restore(path)`` reads it anywhere)."""
        return join(self.directory, str(step), STATE)

    def committed_steps(self) -> list[int]:
        """The steps every host committed, oldest first, as orbax finds them."""
        import orbax.checkpoint as ocp
        from etils import epath

        if not epath.Path(self.directory).exists():
            return []
        return sorted(ocp.path.step.checkpoint_steps(self.directory))

    def pinned_steps(self) -> set[int]:
        """The steps forks still read, which the hosts do not delete (none known when
        the record cannot be read: the hosts then delete nothing)."""
        return pinned_steps(self.directory) or set()

    def kept(self) -> dict[int, str]:
        """The committed steps on storage -> their state item's path."""
        return {step: self.state_path(step) for step in self.committed_steps()}

    def latest_step(self) -> int | None:
        """The newest committed step (a fork that wrote none: its source's step)."""
        steps = self.committed_steps()
        if steps:
            return steps[-1]
        return self._base[1] if self._base is not None else None

    def remove(self) -> None:
        """Deletes the job's whole folder (its checkpoints, TensorBoard scalars and
        profiles), as retention does to a pruned job."""
        from etils import epath

        folder = epath.Path(self.directory)
        if folder.exists():
            folder.rmtree()

    def meta(self, step: int) -> dict[str, Any]:
        """Step ``step``'s meta item (each leaf's shape and dtype, the input positions)."""
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
            return dict(reader.restore(join(self.directory, str(step), META)))

    def state(self, step: int, skeleton: Any, order: Sequence[int]) -> Any:
        """Step ``step``'s state as a result to stream: ``skeleton`` (the state's frozen
        structure, each leaf its index) with every leaf a :class:`RowParts` whose rows
        are read from storage as the stream reaches them (``order``: the leaves'
        indices in the order it does), in one pass over the checkpoint
        (:class:`StateReader`), so no more than a few blocks are held."""
        specs = self.meta(step)["leaves"]
        paths = _leaf_paths(skeleton)
        place = {leaf: k for k, leaf in enumerate(order)}
        reader = StateReader(self.state_path(step), [paths[i] for i in order])

        def leaf(i: int) -> Any:
            spec = specs[i]
            dtype = dtype_from_name(spec["dtype"])
            parts = (np.asarray(block, dtype) for block in reader.blocks(place[i]))
            data = RowParts(tuple(spec["shape"]), dtype, parts)
            return data if spec["key_impl"] is None else trees.KeyData(spec["key_impl"], data)

        return jax.tree.map(leaf, skeleton)  # frozen nodes are pytrees: their leaves


def _leaf_paths(skeleton: Any) -> list[tuple[str, ...]]:
    """Each leaf's key path in the user's pytree, as orbax names its entries."""
    out: dict[int, tuple[str, ...]] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], (*path, str(k)))
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
        elif isinstance(node, trees.Structure):
            for names, v in zip(node.paths, node.leaves, strict=True):
                walk(v, (*path, *names))
        else:
            out[int(node)] = path

    walk(skeleton, ())
    return [out[i] for i in range(len(out))]


class ForkPins:
    """The checkpoints forks read in place, kept from their source's clean-up.

    A fork may start from a checkpoint of a job still running, whose hosts delete all
    but its newest ``keep`` as they save. Each source's folder holds :data:`FORK_PINS`
    (``{fork: step}``), which the hosts' clean-up reads; a fork's entry goes once the
    fork has finished. Written by this service alone, under one lock.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()

    def pin(self, source: str, key: str, step: int) -> set[int]:
        """Pins ``step`` for ``key``; the steps other forks had pinned before."""
        return set(self._update(source, lambda pins: {**pins, key: step}).values())

    def rename(self, source: str, old: str, new: str) -> None:
        self._update(source, lambda pins: {(new if k == old else k): v
                                           for k, v in pins.items()})

    def unpin(self, source: str, key: str) -> None:
        self._update(source, lambda pins: {k: v for k, v in pins.items() if k != key})

    def _update(self, source: str, change: Callable[[dict[str, int]], dict[str, int]]
                ) -> dict[str, int]:
        """Applies ``change`` to ``source``'s pins; the pins as they were."""
        from etils import epath

        folder = epath.Path(join(self.root, source))
        path = folder / FORK_PINS
        with self._lock:
            if not folder.exists():  # no checkpoint to keep (the fork is refused)
                return {}
            pins: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
            new = change(pins)
            if not new and pins:
                path.unlink()
            elif new != pins:
                written = folder / f"{FORK_PINS}.tmp"  # the hosts never read half of it
                written.write_text(json.dumps(new))
                written.replace(path)
            return pins
