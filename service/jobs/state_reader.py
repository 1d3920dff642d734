"""A checkpoint's state read once, front to back, in bounded blocks: a job's result.

``job.result()`` streams a finished job's state from its last checkpoint through the
coordinator. The hosts wrote it with orbax (:mod:`jaxpod.worker.checkpoints`): one
zarr array per leaf in the step's OCDBT database. Restoring it with orbax would hold
the whole state here, and restoring one leaf at a time (every other leaf a
placeholder) costs a pass over the whole tree per leaf: the square of the leaf count.
This reader opens each leaf's array with TensorStore, as orbax's own restore does,
and reads it in blocks of whole chunk rows, issuing opens and reads ahead of the
stream (many small leaves are read concurrently) while holding at most
``budget_bytes`` that the stream has not taken yet, so what the coordinator holds
does not grow with the state.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpod import settings
from jaxpod.pieces import CHUNK_BYTES

#: Bytes read ahead of the stream at most (besides the block it is sending).
READ_AHEAD_BYTES = 2 * CHUNK_BYTES
#: The checkpoint's OCDBT b-tree nodes kept while it is read (the index, not data).
OCDBT_CACHE_BYTES = 16 * 1024 * 1024
#: Arrays opened ahead of the stream at most (their metadata only).
OPENS_AHEAD = 64


@dataclass(frozen=True)
class _Block:
    leaf: int
    start: int
    stop: int  # rows of the leaf's first axis (0, 0 for a scalar)
    nbytes: int


class StateReader:
    """One checkpoint's state item (``<step>/state``), read leaf by leaf in order.

    Args:
      path: the state item's folder (local or ``gs://``).
      names: each leaf's key path in the saved pytree, in the order the stream reads
        the leaves (``blocks(0)``, then ``blocks(1)``...).
      budget_bytes: bytes read ahead at most.
    """

    def __init__(self, path: str, names: Sequence[tuple[str, ...]],
                 budget_bytes: int = READ_AHEAD_BYTES) -> None:
        self._path = path
        self._names = list(names)
        self._budget = budget_bytes
        self._context: Any = None
        self._opening: dict[int, Any] = {}  # leaf -> future of its TensorStore
        self._next_open = 0
        self._plan: collections.deque[_Block] = collections.deque()  # not yet issued
        self._planned = 0  # leaves whose blocks are in the plan
        self._issued: collections.deque[tuple[_Block, Any]] = collections.deque()
        self._ahead = 0  # bytes issued and not yet taken
        self._stores: dict[int, Any] = {}  # opened leaves with blocks still to issue
        self._last_block: dict[int, _Block] = {}

    def blocks(self, leaf: int) -> Iterator[np.ndarray]:
        """Leaf ``leaf``'s rows, block after block (each a C-order numpy array; their
        concatenation along the first axis is the leaf). Leaves must be read in order,
        each once."""
        self._start()
        while True:
            self._pump()
            if not self._issued or self._issued[0][0].leaf != leaf:
                return
            block, future = self._issued.popleft()
            self._ahead -= block.nbytes
            yield np.ascontiguousarray(_result(future, "a block of its state"))

    # --------------------------------------------------------------- internals
    def _start(self) -> None:
        if self._context is not None:
            return
        import tensorstore as ts

        # The spec orbax builds names an OCDBT b-tree node cache; data is not cached.
        self._context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}})
        self._format = _format(self._path)

    def _open(self, leaf: int) -> Any:
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from etils import epath

        use_ocdbt, use_zarr3 = self._format
        # orbax names a leaf's array by its key path joined with dots
        info = ocp.type_handlers.ParamInfo(name=".".join(self._names[leaf]),
                                           parent_dir=epath.Path(self._path),
                                           use_zarr3=use_zarr3)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
        return ts.open(spec, context=self._context, open=True, read=True)

    def _pump(self) -> None:
        """Issues opens and reads ahead, in leaf order, while the budget allows, and
        at least one read whenever none is issued (a block larger than the budget is
        read alone)."""
        count = len(self._names)
        while self._next_open < min(count, self._planned + OPENS_AHEAD):
            self._opening[self._next_open] = self._open(self._next_open)
            self._next_open += 1
        while True:
            if not self._plan:
                if self._planned == count:
                    return
                if self._issued and not self._opening[self._planned].done():
                    return  # read what is issued while the next leaf opens
                self._plan_leaf(self._planned)
                if self._next_open < count:
                    self._opening[self._next_open] = self._open(self._next_open)
                    self._next_open += 1
                continue
            block = self._plan[0]
            if self._issued and self._ahead + block.nbytes > self._budget:
                return
            self._plan.popleft()
            store = self._stores[block.leaf]
            view = store if block.stop == 0 else store[block.start:block.stop]
            self._issued.append((block, view.read()))
            self._ahead += block.nbytes
            if block == self._last_block[block.leaf]:
                del self._stores[block.leaf], self._last_block[block.leaf]

    def _plan_leaf(self, leaf: int) -> None:
        store = _result(self._opening.pop(leaf), "an array of its state")
        self._planned += 1
        shape = tuple(int(n) for n in store.shape)
        itemsize = np.dtype(store.dtype.numpy_dtype).itemsize
        if not shape:
            blocks = [_Block(leaf, 0, 0, itemsize)]
        else:
            row_bytes = itemsize * math.prod(shape[1:])
            chunk_rows = max(1, int(store.chunk_layout.read_chunk.shape[0] or shape[0]))
            per_block = max(1, CHUNK_BYTES // max(1, row_bytes)) // chunk_rows * chunk_rows
            per_block = max(per_block, chunk_rows)  # a chunk is read whole anyway
            blocks = [_Block(leaf, a, min(a + per_block, shape[0]),
                             (min(a + per_block, shape[0]) - a) * row_bytes)
                      for a in range(0, shape[0], per_block)] or [_Block(leaf, 0, 0, 0)]
        self._stores[leaf] = store
        self._last_block[leaf] = blocks[-1]
        self._plan.extend(blocks)


def _format(path: str) -> tuple[bool, bool]:
    """Whether the state item at ``path`` uses OCDBT and zarr3, as its ``_METADATA``
    file (orbax's pytree metadata) records."""
    from etils import epath

    try:
        raw = json.loads((epath.Path(path) / "_METADATA").read_text())
    except FileNotFoundError:
        return True, False
    return bool(raw.get("use_ocdbt", True)), bool(raw.get("use_zarr3", False))


#: How long one read of a stored state (opening an array, a block of one) may take.
READ_TIMEOUT = settings.STORAGE_READ_TIMEOUT


def _result(future: Any, what: str) -> Any:
    """A TensorStore future's result within :data:`READ_TIMEOUT` (a clear error after)."""
    limit = READ_TIMEOUT.seconds()
    try:
        return future.result(timeout=limit)
    except TimeoutError:
        raise TimeoutError(f"Reading {what} from the job's checkpoint took over {limit:g}s "
                           f"({READ_TIMEOUT.env_var}): the checkpoint storage is slow or "
                           "unreachable from the service. Try again, or raise "
                           f"{READ_TIMEOUT.env_var}.") from None
