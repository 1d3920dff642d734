"""Buffers that the receiving end takes in pieces of its own layout.

A host worker sends the rows of a gather as :class:`Streamed` buffers: views of device
memory, with no format of their own. The coordinator's end of the operation channel
receives each under a :class:`PieceLayout` that the coordinator chooses (its result
streams' data chunks, :mod:`jaxpod.proto.tensors`): cut into pieces, each received
straight into its own ``bytes`` object behind the prefix the layout writes, ready to
forward without a copy (:class:`Pieces`). So the bytes of a result stream are owned by
one module, and the rows are copied once, from the worker's memory into those objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: A result stream's data chunk (the last of a tensor may be shorter).
CHUNK_BYTES = 4 * 1024 * 1024


def little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` in C order with little-endian items (the wire's layout), copied only
    when it is not already."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


class Streamed:
    """An array's C-order little-endian bytes (a view: copied only if the array is not
    in that layout), sent by the operation channel as they are and received under the
    receiver's :class:`PieceLayout` as :class:`Pieces`; without one, as ``bytes``.
    Pickled any other way, it becomes ``bytes``."""

    __slots__ = ("data",)

    def __init__(self, array: np.ndarray) -> None:
        flat = little_endian(array).reshape(-1).view(np.uint8)
        self.data = memoryview(flat).toreadonly()  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __reduce__(self) -> tuple[Any, ...]:
        return bytes, (self.data.tobytes(),)


@dataclass(frozen=True)
class PieceLayout:
    """How a receiver cuts :class:`Streamed` buffers: pieces of at most
    ``piece_bytes``, each behind ``prefix(its length)``."""

    piece_bytes: int
    prefix: Callable[[int], bytes]

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be a positive int. Got {self.piece_bytes}.")

    def cut(self, nbytes: int) -> list[int]:
        """The lengths of the pieces of an ``nbytes``-byte buffer (none if empty)."""
        full, rest = divmod(nbytes, self.piece_bytes)
        return [self.piece_bytes] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Pieces:
    """A :class:`Streamed` buffer as received under a layout: its pieces in order,
    each a ``bytes`` object holding its prefix then its part of the buffer, and the
    buffer's size without the prefixes."""

    pieces: list[bytes]
    nbytes: int


@dataclass(frozen=True)
class RowParts:
    """A result of ``shape`` and ``dtype`` sent as the concatenation of ``parts`` along
    axis 0, never joined on the sending side: C-order rows concatenate as bytes do, so
    each part streams as it is (a gather's per-replica parts). ``parts`` is read once,
    as the stream goes (it may still be arriving). A part may come already cut into
    data chunks (``Pieces`` received under the wire's ``DATA_PIECES`` layout), which
    stream as they are."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    parts: Iterable[np.ndarray | Pieces]
