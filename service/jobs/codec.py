"""Trees on disk for the job store: one ``.npz`` per tree, its skeleton beside its
arrays (:mod:`jaxpod.proto.stored` makes and reads the skeleton). No pickle is
unpickled to read a file: plain numpy opens every array (a ``bfloat16`` one as raw
two-byte values, which the skeleton names).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxpod.errors import JaxpodError
from jaxpod.proto import stored
from jaxpod.service.jobs.files import write_file_atomically

#: The npz entry (or file) holding the skeleton.
SKELETON = "__tree__"


class JobStoreError(JaxpodError, ValueError):
    """A value the job store cannot record (nothing of that call was written)."""


def split_tree(tree: Any, where: str, is_leaf: Callable[[Any], bool] | None = None
               ) -> tuple[bytes, list[Any]]:
    """``tree``'s skeleton and its leaves (:func:`jaxpod.proto.stored.split_tree`).

    Raises:
      JobStoreError: a leaf or node that cannot be stored, naming where it is.
    """
    try:
        return stored.split_tree(tree, where, is_leaf)
    except TypeError as e:  # UnsupportedValueError included
        raise JobStoreError(f"Cannot store {where}: {e}") from None


def check_storable(tree: Any, where: str, is_leaf: Callable[[Any], bool]) -> None:
    """Raises :class:`JobStoreError` unless ``tree``, whose leaves ``is_leaf`` accepts
    (values still on a slice), could be stored once its leaves are numpy."""
    split_tree(tree, where, is_leaf)


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
    trees: dict[str, Any] = stored.join_tree(skeleton, [entries[f"leaf_{i}"]
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
