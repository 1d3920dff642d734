"""Predicted outputs, for dispatching an operation without waiting for its reply.

A step function's outputs (their tree, shapes, dtypes and valid rows) are a function
of its arguments' tree, shapes, dtypes and valid rows: that is what the workers'
engine compiles a program for. So the outputs of one successful call, its
*template*, predict those of every later call with the same function and argument
signature, and such a call can return its handles before the service answers. The
service checks each prediction against what the call really made and fails the
operation (``AsyncPredictionError``) where they differ, which only trace-time Python
that reads more than its arguments can cause.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Hashable, Sequence
from typing import Any

from jaxpod.operations import output_id, output_index
from jaxpod.proto import coordinator_pb2 as pb

#: Templates kept per slice.
MAX_TEMPLATES = 1024


class _Unpredictable(Exception):
    """An argument whose effect on the outputs is not known from its shape (an
    uploaded tensor, a leaf of an unknown kind): the call waits for its reply."""


def signature(*trees: pb.Tree, handles: Sequence[Hashable] = ()) -> Hashable | None:
    """What of ``trees`` (encoded arguments) decides a call's outputs, with
    ``handles``, the signatures of the handles in them (their nodes carry only ids);
    ``None``: not predictable."""
    try:
        return (*(_node(t) for t in trees), tuple(handles))
    except _Unpredictable:
        return None


def _node(tree: pb.Tree) -> Hashable:
    kind = tree.WhichOneof("node")
    if kind == "tensor":
        return ("t", tree.tensor.dtype, tuple(tree.tensor.shape))
    if kind == "value":
        return ("v",)  # its shape and rows come in ``handles``
    if kind in ("float_value", "int_value", "bool_value"):
        return ("s", kind)  # traced: only its type shapes the program
    if kind == "str_value":
        return ("str", tree.str_value)
    if kind == "none":
        return ("none",)
    if kind is None:  # a field left unset
        return ("unset",)
    if kind in ("tuple", "list"):
        return (kind, *(_node(t) for t in getattr(tree, kind).items))
    if kind == "dict":
        return ("dict", *(_node(t) for t in tree.dict.keys), *(_node(t) for t in tree.dict.values))
    if kind == "structure":
        s = tree.structure
        return ("struct", hashlib.sha256(s.recipe).hexdigest(), tuple(s.paths),
                *(_node(t) for t in s.leaves))
    if kind == "key":
        return ("key", tree.key.impl, _node(tree.key.data))
    raise _Unpredictable(kind)


class Templates:
    """The outputs of the latest successful call per (operation, signature) key, with
    each value's id reduced to its index among the outputs."""

    def __init__(self) -> None:
        self._by_key: collections.OrderedDict[Hashable, pb.Tree] = collections.OrderedDict()
        self._lock = threading.Lock()  # the stream's reader thread forgets templates

    def predictor(self, key: Hashable) -> Any:
        """A function of an operation's number giving its predicted outputs, or
        ``None`` where no call with ``key`` has succeeded yet."""
        with self._lock:
            template = self._by_key.get(key)
            if template is None:
                return None
            self._by_key.move_to_end(key)

        def predict(op: int) -> pb.Tree:
            tree = pb.Tree()
            tree.CopyFrom(template)
            for ref in value_refs(tree):
                ref.id = output_id(op, ref.id)
            return tree

        return predict

    def record(self, key: Hashable, outputs: pb.Tree) -> None:
        template = pb.Tree()
        template.CopyFrom(outputs)
        for ref in value_refs(template):
            ref.id = output_index(ref.id)
        with self._lock:
            self._by_key[key] = template
            self._by_key.move_to_end(key)
            if len(self._by_key) > MAX_TEMPLATES:
                self._by_key.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._by_key.pop(key, None)


def value_refs(tree: pb.Tree) -> list[pb.ValueRef]:
    """The tree's value references, in no particular order (ids carry their index)."""
    found: list[pb.ValueRef] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = node.WhichOneof("node")
        if kind == "value":
            found.append(node.value)
        elif kind in ("tuple", "list"):
            stack.extend(getattr(node, kind).items)
        elif kind == "dict":
            stack.extend(node.dict.values)
        elif kind == "structure":
            stack.extend(node.structure.leaves)
        elif kind == "key":
            stack.append(node.key.data)
    return found
