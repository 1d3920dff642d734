"""A job's checkpoints as the coordinator sees them: where the hosts write them, which
steps are committed, and a finished job's state read back for its result.

The hosts write every checkpoint themselves, with orbax
(:mod:`jaxpod.worker.checkpoints`), into ``<checkpoint dir>/<job id>/<step>/``, which
every host can reach (a ``gs://`` bucket on GKE, a shared folder on the simulated
cluster). The coordinator tells them when, records each step once they committed it,
and reads the directory through orbax to find committed steps (after its own restart,
or an attempt lost before it heard of a commit); a checkpoint's state never passes
through it, except when a client asks for a finished job's state, which it streams
one leaf at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxpod import trees
from jaxpod.proto.tensors import RowParts, dtype_from_name
from jaxpod.timeouts import Timeout
from jaxpod.worker.checkpoints import META, STATE

logger = logging.getLogger(__name__)

#: Committed checkpoints kept per job (the hosts remove older ones as they commit).
KEEP = Timeout("JAXPOD_JOB_CHECKPOINTS_KEPT", 2)


def join(root: str, *parts: str) -> str:
    """``root`` and ``parts`` joined with ``/`` (a local path or a URL such as gs://)."""
    return "/".join([root.rstrip("/"), *parts])


class JobCheckpoints:
    """One job's checkpoint directory, ``<root>/<job id>``.

    Args:
      root: the service's checkpoint dir (``--checkpoint-dir``).
      job_id: the job.
    """

    def __init__(self, root: str, job_id: str) -> None:
        self.directory = join(root, job_id)

    @property
    def keep(self) -> int:
        return int(KEEP.seconds())

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

    def kept(self) -> dict[int, str]:
        """The committed steps on storage -> their state item's path."""
        return {step: self.state_path(step) for step in self.committed_steps()}

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def meta(self, step: int) -> dict[str, Any]:
        """Step ``step``'s meta item (each leaf's shape and dtype, the input positions)."""
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
            return dict(reader.restore(join(self.directory, str(step), META)))

    def state(self, step: int, skeleton: Any) -> Any:
        """Step ``step``'s state as a result to stream: ``skeleton`` (the state's frozen
        structure, each leaf its index) with every leaf a :class:`RowParts` that reads it
        from storage only as the stream reaches it, so no more than one leaf is held."""
        specs = self.meta(step)["leaves"]
        paths = _leaf_paths(skeleton)

        def leaf(i: int) -> Any:
            spec = specs[i]
            dtype = dtype_from_name(spec["dtype"])
            parts = _LazyLeaf(self.state_path(step), paths[i])
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


class _LazyLeaf:
    """One leaf of a checkpoint's state, read (restored alone, the others left as
    placeholders) when a result stream iterates it."""

    def __init__(self, path: str, names: tuple[str, ...]) -> None:
        self._path = path
        self._names = names

    def __iter__(self) -> Iterator[np.ndarray]:
        import orbax.checkpoint as ocp

        checkpointer = ocp.PyTreeCheckpointer()
        tree = checkpointer.metadata(self._path).item_metadata.tree
        wanted = _placeholders(tree, self._names)
        restored = checkpointer.restore(self._path, args=ocp.args.PyTreeRestore(
            item=wanted, restore_args=_numpy(wanted)))
        yield np.asarray(_at(restored, self._names))


def _placeholders(tree: Any, names: tuple[str, ...], here: tuple[str, ...] = ()) -> Any:
    import orbax.checkpoint as ocp

    if isinstance(tree, dict):
        return {k: _placeholders(v, names, (*here, str(k))) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_placeholders(v, names, (*here, str(i)))
                          for i, v in enumerate(tree))
    return tree if here == names else ocp.PLACEHOLDER


def _numpy(tree: Any) -> Any:
    import jax
    import orbax.checkpoint as ocp

    return jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray)
                        if x is not ocp.PLACEHOLDER else x, tree)


def _at(tree: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        tree = tree[name] if isinstance(tree, dict) else tree[int(name)]
    return tree
