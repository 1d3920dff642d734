"""Trees on disk for the job store: the wire's tree codec, with the arrays beside it.

A tree (a job's state and outputs) is kept as the ``Tree`` message
:mod:`jaxpod.proto.tensors` would send, each array leaf replaced by a ``streamed`` node
naming its dtype and shape, plus the arrays in order. So whatever a strategy or job can
send can be stored, frozen pytrees (:mod:`jaxpod.trees`) included, with no second idea
of what a storable tree is; and no pickle is unpickled to read a file: plain numpy opens
every array (a ``bfloat16`` one as raw two-byte values, which the skeleton names).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpod.errors import JaxpodError
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import tensors
from jaxpod.service.jobs.files import write_file_atomically

#: The npz entry (or file) holding the skeleton.
SKELETON = "__tree__"


class JobStoreError(JaxpodError, ValueError):
    """A value the job store cannot record (nothing of that call was written)."""


def split_tree(tree: Any, where: str, is_leaf: Callable[[Any], bool] | None = None
               ) -> tuple[bytes, list[Any]]:
    """``tree``'s skeleton (serialized) and its array leaves (numpy; with ``is_leaf``,
    also the leaves it accepts, e.g. values still on a slice), in skeleton order.

    Raises:
      JobStoreError: a leaf or node that cannot be stored, naming where it is.
    """
    leaves: list[Any] = []

    def leaf(x: Any, path: str) -> Any:
        if is_leaf is not None and is_leaf(x):  # its bytes are not here: only a place
            leaves.append(x)
            return pb.Tree(streamed=pb.Tensor())
        if isinstance(x, np.ndarray | np.generic):
            if x.dtype.hasobject:
                raise tensors.UnsupportedValueError(
                    f"{path} is an array of Python objects; only numeric arrays are kept.")
            leaves.append(x)
            return pb.Tree(streamed=pb.Tensor(dtype=x.dtype.name, shape=x.shape))
        return tensors.NOT_HANDLED

    try:
        skeleton = tensors.encode(tree, leaf, where)
    except TypeError as e:  # UnsupportedValueError included
        raise JobStoreError(f"Cannot store {where}: {e}") from None
    return skeleton.SerializeToString(), leaves


def check_storable(tree: Any, where: str, is_leaf: Callable[[Any], bool]) -> None:
    """Raises :class:`JobStoreError` unless ``tree``, whose leaves ``is_leaf`` accepts
    (values still on a slice), could be stored once its leaves are numpy."""
    split_tree(tree, where, is_leaf)


def join_tree(skeleton: bytes, arrays: Sequence[np.ndarray]) -> Any:
    """The tree :func:`split_tree` split (the arrays read back, in order)."""
    it: Iterator[np.ndarray] = iter(arrays)

    def leaf(node: pb.Tree) -> Any:
        meta = node.streamed
        array = np.asarray(next(it))
        dtype = tensors.dtype_from_name(meta.dtype)
        if array.dtype != dtype:  # an ml_dtypes array comes back from .npy as raw bytes
            array = array.view(dtype)
        return array.reshape(tuple(meta.shape))

    return tensors.decode(pb.Tree.FromString(skeleton), leaf)


def save_trees(path: Path, trees: Mapping[str, Any]) -> None:
    """Writes named trees to one ``.npz``, whole or not at all."""
    skeleton, arrays = split_tree(dict(trees), "the job's result")
    entries = {f"leaf_{i}": np.asarray(a) for i, a in enumerate(arrays)}
    entries[SKELETON] = np.frombuffer(skeleton, np.uint8)
    write_file_atomically(path, lambda f: np.savez(f, allow_pickle=False, **entries))


def load_trees(path: Path) -> dict[str, Any]:
    """What :func:`save_trees` wrote (or an older jaxpod's result file)."""
    with np.load(path, allow_pickle=False) as npz:
        entries = {key: npz[key] for key in npz.files}
    if SKELETON not in entries:
        return _legacy(entries)
    skeleton = entries.pop(SKELETON).tobytes()
    trees: dict[str, Any] = join_tree(skeleton, [entries[f"leaf_{i}"]
                                                 for i in range(len(entries))])
    return trees


def _legacy(entries: dict[str, np.ndarray]) -> dict[str, Any]:
    """A result file written before the wire codec: a JSON description of dicts, lists,
    tuples and None, and its arrays by key."""
    structure = json.loads(entries.pop("__structure__").tobytes())

    def node(n: Mapping[str, Any]) -> Any:
        kind = n["t"]
        if kind == "none":
            return None
        if kind in ("array", "scalar", "py"):
            array = entries[n["k"]]
            return array if kind == "array" else array[()] if kind == "scalar" else array.item()
        if kind == "dict":
            return {k: node(v) for k, v in n["items"]}
        items = [node(v) for v in n["items"]]
        return items if kind == "list" else tuple(items)

    return {name: node(n) for name, n in structure.items()}


def skeleton_of(tree: Any, is_leaf: Callable[[Any], bool]) -> bytes:
    """``tree``'s structure, each leaf that ``is_leaf`` accepts (a value still on a
    slice) replaced by its index in flatten order: what a restore fills in."""
    import jax

    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    numbered = jax.tree.unflatten(treedef, list(range(len(leaves))))
    return tensors.encode(numbered, path="the job's state").SerializeToString()


def skeleton_from(raw: bytes) -> Any:
    """The numbered structure :func:`skeleton_of` kept (frozen nodes stay frozen)."""
    return tensors.decode(pb.Tree.FromString(raw))
