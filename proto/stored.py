"""What the job store keeps in the wire's format, as bytes: a job's spec and the
skeletons of trees.

A stored spec is the ``JobSpec`` message, so a store written by one jaxpod reads in
the next as the proto evolves. A tree (a job's state, outputs, result) is kept as the
``Tree`` message :mod:`jaxpod.proto.tensors` would send, each array leaf replaced by
a ``streamed`` node naming its dtype and shape, beside the arrays in order: whatever a
strategy or job can send can be stored, with no second idea of what a storable tree
is. The job code sees bytes and plain types; only this module knows they are messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxpod.jobs import JobSpec
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import job_messages, tensors


def spec_payload(spec: JobSpec) -> bytes:
    """``spec`` as the bytes a store keeps."""
    return job_messages.to_message(spec).SerializeToString()


def spec_from_payload(raw: bytes) -> JobSpec:
    """The spec :func:`spec_payload` made."""
    return job_messages.from_message(JobSpec, pb.JobSpec.FromString(raw))


def split_tree(tree: Any, where: str, is_leaf: Callable[[Any], bool] | None = None
               ) -> tuple[bytes, list[Any]]:
    """``tree``'s skeleton and its array leaves (numpy; with ``is_leaf``, also the
    leaves it accepts, e.g. values still on a slice), in skeleton order.

    Raises:
      TypeError: a leaf or node that cannot be stored, naming where it is.
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

    return tensors.encode(tree, leaf, where).SerializeToString(), leaves


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


def stream_order(skeleton: Any) -> list[int]:
    """The leaf indices of a numbered skeleton in the order a result stream sends
    their bytes (:func:`~jaxpod.proto.tensors.split_result` encodes front to back)."""
    order: list[int] = []

    def visit(node: Any, path: str) -> Any:
        if isinstance(node, int) and not isinstance(node, bool):
            order.append(node)
        return tensors.NOT_HANDLED

    tensors.encode(skeleton, visit)
    return order
