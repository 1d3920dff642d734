"""Length-prefixed pieces: an array's bytes cut into pieces that each start with a tag
and their length, laid out in one buffer so that every piece can be sent as it is.

A host worker cuts gathered rows this way, in the form the coordinator's result
streams carry (a ``ResultChunk.data`` field: tag ``0x12``, then the length as a
varint), so the coordinator forwards each piece it receives without copying it. The
format is plain data here because workers do not import the wire protocol.
"""

from __future__ import annotations

import pickle
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


@dataclass(frozen=True)
class Framed:
    """An array's bytes as framed pieces, in order. A worker builds them as
    ``pickle.PickleBuffer`` views of one buffer (sent out of band, no copy); the
    receiver of an operation channel gets each as ``bytes``."""

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
        """``array``'s C-order little-endian bytes, framed (one copy of the bytes)."""
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        starts = range(0, len(data), self.piece_bytes)
        headers = [self.header(min(self.piece_bytes, len(data) - s)) for s in starts]
        out = np.empty(len(data) + sum(map(len, headers)), np.uint8)
        pieces, at = [], 0
        for start, header in zip(starts, headers, strict=True):
            body = data[start:start + self.piece_bytes]
            end = at + len(header) + len(body)
            out[at:at + len(header)] = np.frombuffer(header, np.uint8)
            out[at + len(header):end] = body
            piece = memoryview(out[at:end]).toreadonly()  # type: ignore[arg-type]
            pieces.append(pickle.PickleBuffer(piece))
            at = end
        return Framed(pieces, len(data))
