"""Length-prefixed pieces: an array's bytes cut into pieces that each start with a tag
and their length, so that every piece can be forwarded as it is.

A host worker cuts gathered rows this way, in the form the coordinator's result
streams carry (a ``ResultChunk.data`` field: tag ``0x12``, then the length as a
varint), so the coordinator forwards each piece it receives without copying it. The
worker copies nothing either: a piece is its header and a view of the rows
(:class:`Segments`), which the operation channel sends back to back and the other end
receives as one ``bytes`` object. The format is plain data here because workers do not
import the wire protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def varint(n: int) -> bytes:
    """``n`` as an unsigned LEB128 varint (protobuf's length encoding)."""
    if n < 0:
        raise ValueError(f"varint takes a nonnegative int. Got {n}.")
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` in C order with little-endian items (the wire's layout), copied only
    when it is not already."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


class Segments:
    """Buffers that travel as one: the operation channel sends them back to back,
    without joining them, and the other end receives their concatenation as a single
    buffer. Pickled any other way, they become that concatenation as ``bytes``."""

    __slots__ = ("parts",)

    def __init__(self, *parts: Any) -> None:
        self.parts = tuple(memoryview(p).cast("B") for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def tobytes(self) -> bytes:
        return b"".join(self.parts)

    def __reduce__(self) -> tuple[Any, ...]:
        return bytes, (self.tobytes(),)


@dataclass(frozen=True)
class Framed:
    """An array's bytes as framed pieces, in order. A worker builds them as
    :class:`Segments` (a header and a view of the array: no copy); the receiver of
    an operation channel gets each as one ``bytes`` object."""

    pieces: list[Any]
    nbytes: int  # the array's bytes, without the frames


@dataclass(frozen=True)
class Framing:
    """How to cut an array's bytes: pieces of at most ``piece_bytes`` bytes, each
    preceded by ``tag`` and its length as a :func:`varint`."""

    tag: bytes
    piece_bytes: int

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be a positive int. Got {self.piece_bytes}.")

    def header(self, length: int) -> bytes:
        """What precedes a piece of ``length`` bytes."""
        return self.tag + varint(length)

    def frame(self, array: np.ndarray) -> Framed:
        """``array``'s C-order little-endian bytes, framed: the pieces are views of
        ``array`` (copied only if it is not C-contiguous or little-endian)."""
        flat = little_endian(array).reshape(-1).view(np.uint8)
        data = memoryview(flat).toreadonly()  # type: ignore[arg-type]
        pieces = [Segments(self.header(len(body)), body)
                  for body in (data[s:s + self.piece_bytes]
                               for s in range(0, len(data), self.piece_bytes))]
        return Framed(pieces, len(data))
