"""Wire forms of values, shared by the client and the coordinator.

Arrays travel as :class:`Tensor` messages (numpy dtype name, shape, C-order
little-endian bytes; ``bfloat16`` and the other ``ml_dtypes`` types included). Nests
of arguments and results travel as :class:`Tree` messages; the leaves that are not
plain data (remote values, uploaded tensors) are left to callbacks so each side
decides what they mean. Any other pytree node and typed PRNG keys travel frozen
(:mod:`jaxpod.trees`): ``encode`` freezes what it meets, ``decode`` gives the frozen
nodes back, and the ends that run user code thaw them. Large results stream as a
skeleton followed by byte chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxpod import trees
from jaxpod.pieces import CHUNK_BYTES as CHUNK_BYTES
from jaxpod.pieces import PieceLayout, Pieces, little_endian
from jaxpod.pieces import RowParts as RowParts
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.trees import dtype_from_name as dtype_from_name

#: Version of the protocol; a client and a service must agree on it.
PROTOCOL_VERSION = 4
#: The largest message either side accepts; larger tensors go through ``Put`` or
#: result streams in chunks of ``CHUNK_BYTES``.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Tensors up to this size travel inline in a result skeleton.
INLINE_BYTES = 256 * 1024
#: Metadata carries pickled exceptions and remote tracebacks back to clients.
MAX_METADATA_BYTES = 1024 * 1024
#: Trailers of an error status: the exception (cloudpickle) and the remote traceback.
ERROR_TRAILER = "jaxpod-error-bin"
TRACEBACK_TRAILER = "jaxpod-traceback-bin"


def holder_label(session_id: str) -> str:
    """How cluster status names the session holding a slice: a digest of its id, which
    cannot stand in for the id (the id is what authorizes a session's calls)."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


def channel_options() -> list[tuple[str, int]]:
    """Message and metadata limits, the same on the server and the client."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES)]

_INT64 = (-(2**63), 2**63 - 1)

#: What a leaf callback returns when it does not handle the leaf.
NOT_HANDLED = object()


class UnsupportedValueError(TypeError):
    """A value of a type that cannot travel to the workers."""


def wire_array(value: Any, path: str = "value") -> np.ndarray:
    """``value`` (numpy, jax or anything ``np.asarray`` takes) as numpy in the wire's
    layout; ``path`` names it in the error for arrays that cannot travel."""
    array = little_endian(np.asarray(value))
    if array.dtype.hasobject:
        raise UnsupportedValueError(
            f"{path}: arrays of dtype object cannot be sent (got shape {array.shape}); "
            "convert them to a numeric dtype first.")
    return array


def to_tensor(value: Any, path: str = "value") -> pb.Tensor:
    """``value`` as a ``Tensor`` (see :func:`wire_array`)."""
    array = wire_array(value, path)
    return pb.Tensor(dtype=array.dtype.name, shape=array.shape, data=array.tobytes())


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """A writable numpy array with the tensor's dtype, shape and data."""
    dtype = dtype_from_name(tensor.dtype)
    shape = tuple(tensor.shape)
    expected = nbytes(tensor)
    if len(tensor.data) != expected:
        raise ValueError(f"Tensor of dtype {tensor.dtype} and shape {list(shape)} needs "
                         f"{expected} bytes; the message has {len(tensor.data)}.")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).copy()


def nbytes(tensor_meta: pb.Tensor) -> int:
    """The bytes a tensor of this dtype and shape holds (its data's expected length)."""
    dtype = dtype_from_name(tensor_meta.dtype)
    return int(np.prod(tuple(tensor_meta.shape), dtype=np.int64)) * dtype.itemsize


# ------------------------------------------------------------------------- trees
LeafEncoder = Callable[[Any, str], Any]  # (leaf, path) -> pb.Tree | NOT_HANDLED
LeafDecoder = Callable[[pb.Tree], Any]   # ValueRef / blob node -> Python value


def encode(value: Any, leaf: LeafEncoder | None = None, path: str = "args") -> pb.Tree:
    """A pytree as a ``Tree``: tuples, lists, dicts, scalars and arrays as themselves,
    other nodes and typed keys frozen (:func:`jaxpod.trees.freeze`).

    Args:
      value: the nest.
      leaf: called first on every node; returns a ``Tree`` for values it owns (remote
        values, large arrays to upload) or ``NOT_HANDLED``.
      path: where ``value`` sits, for error messages (``args[1]['x']``).

    Raises:
      UnsupportedValueError: a leaf of a type that cannot travel, naming its path.
      TypeError: a node whose structure cannot be pickled, naming its path.
    """
    if leaf is not None:
        handled = leaf(value, path)
        if handled is not NOT_HANDLED:
            return handled
    if value is None:
        return pb.Tree(none=True)
    if isinstance(value, bool):
        return pb.Tree(bool_value=value)
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise UnsupportedValueError(
                f"{path}: the int {value} does not fit in 64 bits; pass it as an array "
                "of a wide enough dtype.")
        return pb.Tree(int_value=value)
    if isinstance(value, float):
        return pb.Tree(float_value=value)
    if isinstance(value, str):
        return pb.Tree(str_value=value)
    if isinstance(value, trees.Structure):
        return pb.Tree(structure=pb.Structure(
            recipe=value.recipe, type_name=value.type_name,
            paths=trees.paths_to_json(value.paths),
            leaves=[encode(v, leaf, path + "".join(f"[{n!r}]" for n in p))
                    for p, v in zip(value.paths, value.leaves, strict=True)]))
    if isinstance(value, trees.KeyData):
        return pb.Tree(key=pb.KeyData(impl=value.impl, data=encode(value.data, leaf, path)))
    if isinstance(value, np.ndarray | np.generic):
        return pb.Tree(tensor=to_tensor(value, path))
    if type(value) not in (tuple, list, dict):  # a NamedTuple, a State, a typed key...
        frozen = trees.freeze(value, path)
        if frozen is not value:
            return encode(frozen, leaf, path)
    if isinstance(value, tuple):
        return pb.Tree(tuple=pb.Sequence(
            items=[encode(v, leaf, f"{path}[{i}]") for i, v in enumerate(value)]))
    if isinstance(value, list):
        return pb.Tree(list=pb.Sequence(
            items=[encode(v, leaf, f"{path}[{i}]") for i, v in enumerate(value)]))
    if isinstance(value, dict):
        keys = list(value)
        return pb.Tree(dict=pb.Mapping(
            keys=[encode(k, None, f"{path} key") for k in keys],
            values=[encode(value[k], leaf, f"{path}[{k!r}]") for k in keys]))
    if _is_jax_array(value):
        return pb.Tree(tensor=to_tensor(value, path))
    raise UnsupportedValueError(
        f"{path}: values of type {type(value).__module__}.{type(value).__qualname__} cannot "
        "travel: leaves of what a strategy or job sends and returns must be numpy or jax "
        "arrays (typed PRNG keys included), Python numbers, strings, None, or values this "
        "strategy returned; any pytree JAX can flatten may hold them.")


def _is_jax_array(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith(("jax", "jaxlib")) and hasattr(value, "__array__")


def decode(tree: pb.Tree, leaf: LeafDecoder | None = None) -> Any:
    """The Python nest a ``Tree`` encodes; ``leaf`` decodes value and blob nodes."""
    kind = tree.WhichOneof("node")
    if kind == "tensor":
        return from_tensor(tree.tensor)
    if kind in ("value", "blob", "streamed"):
        if leaf is None:
            raise ValueError(f"A {kind} node needs a decoder on this side.")
        return leaf(tree)
    if kind in ("tuple", "list"):
        items = [decode(t, leaf) for t in getattr(tree, kind).items]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {decode(k): decode(v, leaf)
                for k, v in zip(tree.dict.keys, tree.dict.values, strict=True)}
    if kind == "structure":
        node = tree.structure
        paths = trees.paths_from_json(node.paths)
        if len(paths) != len(node.leaves):
            raise ValueError(f"A {node.type_name} structure names {len(paths)} leaf paths "
                             f"but carries {len(node.leaves)} leaves.")
        return trees.Structure(node.recipe, node.type_name, paths,
                               tuple(decode(v, leaf) for v in node.leaves))
    if kind == "key":
        return trees.KeyData(tree.key.impl, decode(tree.key.data, leaf))
    if kind in ("float_value", "int_value", "bool_value", "str_value"):
        return getattr(tree, kind)
    if kind == "none" or kind is None:
        return None
    raise ValueError(f"Unknown tree node {kind!r}.")


# ----------------------------------------------------------------- result streams
def split_result(value: Any, chunk_bytes: int = CHUNK_BYTES
                 ) -> tuple[pb.ResultChunk, Iterator[list[bytes]] | None]:
    """A numpy nest as a result stream: the skeleton message, then the bytes of large
    tensors in chunks of at most ``chunk_bytes`` (``None`` when everything fits in the
    skeleton). The chunks come in runs, each ready once the iterator yields it: a
    server takes each run off its event loop (the iterator copies, or waits for the
    workers), then sends its chunks.

    Tensors up to ``INLINE_BYTES`` travel inside the skeleton; larger ones (and every
    :class:`RowParts`) are marked ``streamed`` and follow, in skeleton order. The data
    chunks come already serialized (one copy of the bytes, where building
    ``ResultChunk`` messages would take three): send them with
    :func:`serialize_chunk`."""
    big: list[Iterable[np.ndarray | Pieces]] = []

    def leaf(x: Any, path: str) -> Any:
        if isinstance(x, RowParts):
            big.append(x.parts)
            return pb.Tree(streamed=pb.Tensor(dtype=x.dtype.name, shape=x.shape))
        if isinstance(x, np.ndarray | np.generic):
            array = np.asarray(x)
            if array.nbytes > INLINE_BYTES:  # cut into data chunks as it streams
                big.append((array,))
                return pb.Tree(streamed=pb.Tensor(dtype=array.dtype.name, shape=array.shape))
        return NOT_HANDLED

    skeleton = pb.ResultChunk(skeleton=encode(value, leaf, "result"))
    return skeleton, (_data_chunks(big, chunk_bytes) if big else None)


def _data_chunks(big: list[Iterable[np.ndarray | Pieces]], chunk_bytes: int
                 ) -> Iterator[list[bytes]]:
    for parts in big:
        for part in parts:
            if isinstance(part, Pieces):  # received as data chunks already
                yield part.pieces
            else:  # one copy: each chunk's prefix and bytes joined
                flat = memoryview(little_endian(part).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                for at in range(0, flat.nbytes, chunk_bytes):
                    body = flat[at:at + chunk_bytes]
                    yield [_data_prefix(body.nbytes) + body]


#: The wire tag of ``ResultChunk.data`` (field 2, length-delimited).
_DATA_FIELD = bytes([2 << 3 | 2])


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


def _data_prefix(length: int) -> bytes:
    """What precedes ``length`` bytes of data to make a serialized data chunk message
    (a ``ResultChunk`` holding only its ``data`` field)."""
    return _DATA_FIELD + varint(length)


#: How a coordinator receives a worker's ``Streamed`` rows: as serialized data chunks
#: (:class:`~jaxpod.pieces.Pieces`), which a ``RowParts`` result streams as they are.
DATA_PIECES = PieceLayout(piece_bytes=CHUNK_BYTES, prefix=_data_prefix)


def serialize_chunk(chunk: pb.ResultChunk | bytes) -> bytes:
    """A result stream message's wire form (data chunks are serialized already)."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def parse_chunk(message: bytes) -> pb.ResultChunk | memoryview:
    """A received result stream message: a data chunk as a view of the message's own
    bytes (parsing it as a ``ResultChunk`` would copy them twice), anything else parsed.

    Only a message holding exactly one ``data`` field takes the short path, so the
    wire form of a data chunk from any sender parses the same either way."""
    if message[:1] == _DATA_FIELD:
        length, shift, at = 0, 0, 1
        while at < len(message) and at <= 10:
            byte = message[at]
            length |= (byte & 0x7F) << shift
            shift, at = shift + 7, at + 1
            if byte < 0x80:
                if at + length == len(message):
                    return memoryview(message)[at:]
                break
    return pb.ResultChunk.FromString(message)


def read_result(chunks: Iterable[pb.ResultChunk | memoryview]) -> Any:
    """Rebuilds the nest a :func:`split_result` stream sent (arrays writable, no extra
    copy); data chunks may come as ``ResultChunk`` messages or as :func:`parse_chunk`
    views."""
    it = iter(chunks)
    first = next(it, None)
    if not isinstance(first, pb.ResultChunk) or not first.HasField("skeleton"):
        raise ValueError("The result stream did not start with its skeleton.")
    buffers: list[np.ndarray] = []  # each tensor's bytes, flat

    def leaf(node: pb.Tree) -> Any:
        meta = node.streamed
        array = np.empty(tuple(meta.shape), dtype=dtype_from_name(meta.dtype))
        buffers.append(array.reshape(-1).view(np.uint8))
        return array

    value = decode(first.skeleton, leaf)
    index, offset = 0, 0
    for chunk in it:
        # numpy copies without holding the GIL: gRPC's receiving thread goes on meanwhile
        data = np.frombuffer(chunk if isinstance(chunk, memoryview) else chunk.data, np.uint8)
        while len(data):
            while index < len(buffers) and offset == len(buffers[index]):
                index, offset = index + 1, 0
            if index == len(buffers):
                raise ValueError("The result stream carried more bytes than its skeleton.")
            flat = buffers[index]
            n = min(len(data), len(flat) - offset)
            flat[offset:offset + n] = data[:n]
            offset += n
            data = data[n:]
    while index < len(buffers) and offset == len(buffers[index]):
        index, offset = index + 1, 0
    if index != len(buffers):
        raise ValueError("The result stream ended before all its tensors arrived.")
    return value
