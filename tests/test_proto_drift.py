"""The wire protocol: generated modules in step with the .proto, and the tensor codec.

The checked-in ``proto/*_pb2*.py`` must be exactly what ``python -m jaxpod.proto.regen``
produces from ``proto/coordinator.proto`` (grpcio-tools is pinned for this). The codec
tests round-trip arrays of every dtype the service carries, pytrees and chunked result
streams through real protobuf messages (serialized and parsed again), and compare
with numpy.
"""

from __future__ import annotations

import itertools
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpod.pieces import Pieces
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import regen, tensors

GENERATED = ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py")


# ------------------------------------------------------------------------ drift
def test_generated_modules_match_the_proto() -> None:
    generated = regen.generate()
    assert sorted(generated) == sorted(GENERATED)
    assert all(generated.values()), "protoc produced an empty module"
    assert regen.drifted() == [], (
        "proto/ is stale; run: python -m jaxpod.proto.regen")


def test_regen_check_command_exits_zero() -> None:
    result = subprocess.run([sys.executable, "-m", "jaxpod.proto.regen", "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_drift_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """The check is not vacuous: an edited or missing module is reported."""
    shutil.copy(regen.HERE / "coordinator.proto", tmp_path)
    for name in GENERATED:
        shutil.copy(regen.HERE / name, tmp_path)
    monkeypatch.setattr(regen, "HERE", tmp_path)
    assert regen.drifted() == []
    with (tmp_path / "coordinator_pb2_grpc.py").open("a") as f:
        f.write("# hand edit\n")
    (tmp_path / "coordinator_pb2.pyi").unlink()
    assert sorted(regen.drifted()) == ["coordinator_pb2.pyi", "coordinator_pb2_grpc.py"]
    assert regen.main(["--check"]) == 1
    assert "proto/coordinator_pb2_grpc.py is stale" in capsys.readouterr().err


# ------------------------------------------------------------------------ codec
def _wire(message: Any) -> Any:
    """``message`` after a trip through its serialized form."""
    return type(message).FromString(message.SerializeToString())


def _assert_same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape
    assert got.flags.writeable and got.flags.c_contiguous
    # Bytes, not values: also exact for NaN payloads and ml_dtypes types.
    assert got.tobytes() == np.ascontiguousarray(want.astype(got.dtype)).tobytes()


_RNG = np.random.default_rng(0)
_ARRAYS = {
    "float32": _RNG.normal(size=(3, 4)).astype(np.float32),
    "float64": _RNG.normal(size=(5,)),
    "float16": _RNG.normal(size=(2, 2)).astype(np.float16),
    "bfloat16": _RNG.normal(size=(4, 3)).astype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.array([0.5, -1.0, 2.0], dtype=ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.array([0.25, -4.0], dtype=ml_dtypes.float8_e5m2),
    "int4": np.array([-8, -1, 0, 7], dtype=ml_dtypes.int4),
    "uint4": np.array([0, 3, 15], dtype=ml_dtypes.uint4),
    "bool": np.array([[True, False], [False, True]]),
    "int8": np.array([-128, -1, 0, 127], dtype=np.int8),
    "uint8": np.arange(256, dtype=np.uint8),
    "int16": np.array([-(2**15), 2**15 - 1], dtype=np.int16),
    "uint16": np.array([0, 2**16 - 1], dtype=np.uint16),
    "int32": np.arange(-6, 6, dtype=np.int32).reshape(3, 2, 2),
    "uint32": np.array([0, 2**32 - 1], dtype=np.uint32),
    "int64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "uint64": np.array([0, 2**64 - 1, 12345678901234567890], dtype=np.uint64),
    "complex64": (_RNG.normal(size=3) + 1j * _RNG.normal(size=3)).astype(np.complex64),
    "complex128": np.array([1 + 2j, -3.5 - 0.25j]),
    "0-d": np.array(7.25, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.int32),
    "empty-bf16": np.zeros((2, 0), dtype=ml_dtypes.bfloat16),
    "big-endian-f32": np.arange(6, dtype=">f4").reshape(2, 3),
    "big-endian-i64": np.array([1, -2, 2**40], dtype=">i8"),
    "big-endian-c8": np.array([1 - 1j, 2.5j], dtype=">c8"),
    "non-contiguous": np.arange(48, dtype=np.float64).reshape(6, 8)[::2, 1::3],
    "transposed": np.arange(12, dtype=np.int16).reshape(3, 4).T,
    "nan-inf": np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float32),
}


@pytest.mark.parametrize("name", list(_ARRAYS))
def test_tensor_round_trip(name: str) -> None:
    array = _ARRAYS[name]
    tensor = _wire(tensors.to_tensor(array))
    assert tensor.dtype == array.dtype.name
    assert list(tensor.shape) == list(array.shape)
    assert len(tensor.data) == array.size * array.dtype.itemsize == tensors.nbytes(tensor)
    back = tensors.from_tensor(tensor)
    _assert_same_array(back, array)
    if array.dtype.kind in "biufc":
        np.testing.assert_array_equal(back, array)  # values too, whatever the byte order


def test_tensor_wire_bytes_are_little_endian_c_order() -> None:
    big = np.array([[1, 2], [3, 4]], dtype=">i4").T  # big-endian and F-ordered
    tensor = tensors.to_tensor(big)
    assert tensor.data == np.array([[1, 3], [2, 4]], dtype="<i4").tobytes()


def test_scalars_and_jax_arrays_become_tensors() -> None:
    for value, want in ((np.float32(1.5), np.array(1.5, np.float32)),
                        (np.int8(-3), np.array(-3, np.int8)),
                        (jnp.arange(4, dtype=jnp.int32), np.arange(4, dtype=np.int32)),
                        (jnp.ones((2, 2), jnp.bfloat16), np.ones((2, 2), ml_dtypes.bfloat16))):
        tree = _wire(tensors.encode(value))
        assert tree.WhichOneof("node") == "tensor"
        _assert_same_array(tensors.decode(tree), want)


def test_from_tensor_rejects_bad_messages() -> None:
    with pytest.raises(ValueError, match="needs 24 bytes; the message has 20"):
        tensors.from_tensor(pb.Tensor(dtype="float64", shape=[3], data=b"\0" * 20))
    with pytest.raises(ValueError, match="Unknown tensor dtype 'float99'"):
        tensors.from_tensor(pb.Tensor(dtype="float99", shape=[1], data=b"\0"))
    with pytest.raises(ValueError, match="cannot travel as raw bytes"):
        tensors.dtype_from_name("object")
    with pytest.raises(tensors.UnsupportedValueError, match="dtype object"):
        tensors.to_tensor(np.array([1, "a"], dtype=object))
    # inside a nest, and on the way to an upload, the error names where it sits
    with pytest.raises(tensors.UnsupportedValueError,
                       match=r"^args\[1\]\['x'\]: arrays of dtype object"):
        tensors.encode((1, {"x": np.array([1, "a"], dtype=object)}))
    with pytest.raises(tensors.UnsupportedValueError, match=r"^args\[0\]: arrays of dtype"):
        tensors.wire_array(np.empty(3, dtype=object), "args[0]")


def test_nested_tree_round_trip() -> None:
    value = {
        "tuple": (1, 2.5, "three", None, True),
        "list": [False, -(2**63), 2**63 - 1, [[], ()], {}],
        "arrays": (np.arange(3, dtype=np.uint64), [np.ones((2, 0), np.float32)]),
        7: {"inner": (np.array(True), np.float32(-0.5))},
        "": "",
    }
    back = tensors.decode(_wire(tensors.encode(value)))
    assert set(back) == set(value)
    assert back["tuple"] == value["tuple"]
    assert [type(x) for x in back["tuple"]] == [int, float, str, type(None), bool]
    assert back["list"][:3] == [False, -(2**63), 2**63 - 1]
    assert type(back["list"][0]) is bool
    assert back["list"][3] == [[], ()] and back["list"][4] == {}
    assert type(back["arrays"]) is tuple and type(back["arrays"][1]) is list
    _assert_same_array(back["arrays"][0], value["arrays"][0])
    _assert_same_array(back["arrays"][1][0], value["arrays"][1][0])
    _assert_same_array(back[7]["inner"][0], np.array(True))
    _assert_same_array(back[7]["inner"][1], np.array(-0.5, np.float32))
    assert back[""] == ""


def test_unsupported_leaf_names_its_path() -> None:
    class Opaque:
        pass

    with pytest.raises(tensors.UnsupportedValueError,
                       match=r"args\[1\]\['x'\]\[0\]: values of type .*Opaque cannot travel"):
        tensors.encode((np.zeros(2), {"x": [Opaque()]}))
    with pytest.raises(TypeError, match=r"kwargs\['s'\]: .*builtins.set"):
        tensors.encode({"s": {1, 2}}, path="kwargs")
    with pytest.raises(tensors.UnsupportedValueError, match=r"args\[0\]: the int 18446744073"):
        tensors.encode((2**64,))


class _Point(NamedTuple):
    x: Any
    y: Any


def test_any_pytree_travels_frozen_and_thaws_to_its_type() -> None:
    """NamedTuples, OrderedDicts, registered classes and typed keys cross the wire as
    frozen nodes: the decoding side holds them opaque (the coordinator), the user's
    side thaws them to the same types; leaves keep their paths for errors."""
    import collections

    import jax

    from jaxpod import trees

    value = {"p": _Point(np.arange(2, dtype=np.float32), [np.int8(3)]),
             "od": collections.OrderedDict(b=1.0, a=np.zeros(1)),
             "key": jax.random.split(jax.random.key(1), 3)}
    decoded = tensors.decode(_wire(tensors.encode(value)))
    assert type(decoded["p"]) is trees.Structure and type(decoded["key"]) is trees.KeyData
    assert decoded["p"].paths == (("x",), ("y", "0"))
    assert decoded["p"].type_name.endswith("_Point")
    back = trees.thaw(decoded)
    assert type(back["p"]) is _Point and type(back["od"]) is collections.OrderedDict
    assert list(back["od"]) == ["b", "a"]
    _assert_same_array(back["p"].x, value["p"].x)
    np.testing.assert_array_equal(jax.random.key_data(back["key"]),
                                  jax.random.key_data(value["key"]))
    # A leaf that cannot travel is named by its path inside the structure.
    with pytest.raises(tensors.UnsupportedValueError, match=r"args\['p'\]\['y'\]"):
        tensors.encode({"p": _Point(1.0, {1, 2})})


def test_a_structure_whose_type_is_missing_thaws_to_dicts() -> None:
    from jaxpod import trees

    frozen = trees.Structure(b"not a pickle", "somewhere.Missing",
                             (("a", "b"), ("c",)), (np.ones(1), np.zeros(1)))
    with pytest.raises(trees.RecipeError, match=r"somewhere\.Missing cannot be rebuilt"):
        trees.thaw(frozen)
    notes: list[str] = []
    back = trees.thaw(frozen, unknown_as_dicts=True, notes=notes)
    assert set(back) == {"a", "c"} and set(back["a"]) == {"b"}
    assert notes and "nested dicts" in notes[0]


def test_leaf_callbacks_own_their_values() -> None:
    class Remote:
        def __init__(self, ident: int) -> None:
            self.ident = ident

    paths: list[str] = []

    def leaf(x: Any, path: str) -> Any:
        paths.append(path)
        if isinstance(x, Remote):
            return pb.Tree(value=pb.ValueRef(id=x.ident, slice_id="s"))
        return tensors.NOT_HANDLED

    tree = _wire(tensors.encode({"a": (Remote(3), 1)}, leaf))
    assert "args['a'][0]" in paths and "args['a'][1]" in paths
    back = tensors.decode(tree, lambda node: ("ref", node.value.id))
    assert back == {"a": (("ref", 3), 1)}
    with pytest.raises(ValueError, match="A value node needs a decoder"):
        tensors.decode(tree)


def _result_stream(value: Any, chunk_bytes: int = tensors.CHUNK_BYTES) -> list[Any]:
    """The messages a client receives for ``value``: the skeleton, then the data
    chunks the service serialized by hand, parsed as ``ResultChunk``."""
    skeleton, data = tensors.split_result(value, chunk_bytes)
    return [_wire(skeleton), *(pb.ResultChunk.FromString(tensors.serialize_chunk(c))
                               for run in data or () for c in run)]


def test_result_stream_round_trip_in_small_chunks() -> None:
    big = np.arange(tensors.INLINE_BYTES // 4 + 1001, dtype=np.float32)  # > INLINE_BYTES
    big_be = np.arange(70_000, dtype=">i8").reshape(700, 100)[:, ::2]  # 280 KB, strided
    small = np.arange(10, dtype=np.int16)
    value = {"big": big, "parts": (small, big_be), "n": 3, "none": None}
    chunk_bytes = 1000
    chunks = _result_stream(value, chunk_bytes)

    skeleton = chunks[0].skeleton
    assert not chunks[0].data
    streamed = [n for n in (skeleton.dict.values[0], skeleton.dict.values[1].tuple.items[1])]
    assert [n.WhichOneof("node") for n in streamed] == ["streamed", "streamed"]
    assert skeleton.dict.values[1].tuple.items[0].WhichOneof("node") == "tensor"  # inline
    want_chunks = sum(math.ceil(a.nbytes / chunk_bytes) for a in (big, big_be))
    assert len(chunks) == 1 + want_chunks
    assert all(0 < len(c.data) <= chunk_bytes for c in chunks[1:])

    back = tensors.read_result(chunks)
    _assert_same_array(back["big"], big)
    _assert_same_array(back["parts"][0], small)
    _assert_same_array(back["parts"][1], big_be)
    np.testing.assert_array_equal(back["parts"][1], big_be)
    assert back["n"] == 3 and back["none"] is None

    # Chunks need not line up with tensors: regroup the same bytes arbitrarily.
    data = b"".join(c.data for c in chunks[1:])
    regrouped = [chunks[0]] + [pb.ResultChunk(data=data[i:i + 777_777])
                               for i in range(0, len(data), 777_777)]
    _assert_same_array(tensors.read_result(regrouped)["parts"][1], big_be)

    with pytest.raises(ValueError, match="ended before all its tensors arrived"):
        tensors.read_result(chunks[:-1])
    with pytest.raises(ValueError, match="more bytes than its skeleton"):
        tensors.read_result([*chunks, pb.ResultChunk(data=b"x")])


def test_received_pieces_stream_as_they_are_and_parse_without_copies() -> None:
    """Rows received under DATA_PIECES are forwarded piece by piece; a client reading
    them with parse_chunk gets views that match what protobuf parses."""
    rng = np.random.default_rng(3)
    parts = [rng.normal(size=(n, 300)).astype(ml_dtypes.bfloat16) for n in (5000, 1, 0, 3001)]
    layout = tensors.DATA_PIECES
    # as the coordinator's channel receives a Streamed part: each piece behind its prefix
    received_parts = []
    for part in parts[:2]:
        data = part.tobytes()
        cut = np.cumsum([0, *layout.cut(len(data))])
        received_parts.append(Pieces([layout.prefix(b - a) + data[a:b]
                                      for a, b in itertools.pairwise(cut)],
                                     len(data)))
    pieces = [p for r in received_parts for p in r.pieces]
    assert len(pieces) == 2  # 3 MB in one CHUNK_BYTES piece, 600 bytes in another
    sent = [*received_parts, *parts[2:]]  # mixed with plain parts
    rows = tensors.RowParts((sum(len(p) for p in parts), 300), parts[0].dtype, sent)
    skeleton, data = tensors.split_result({"rows": rows})
    messages = [skeleton.SerializeToString(),
                *(tensors.serialize_chunk(c) for run in data or () for c in run)]
    assert pieces == messages[1:1 + len(pieces)]  # forwarded as they are

    received = [tensors.parse_chunk(m) for m in messages]
    assert isinstance(received[0], pb.ResultChunk)
    assert all(isinstance(r, memoryview) for r in received[1:])
    assert [bytes(r) for r in received[1:]] == [pb.ResultChunk.FromString(m).data
                                                for m in messages[1:]]
    np.testing.assert_array_equal(tensors.read_result(received)["rows"],
                                  np.concatenate(parts))
    # Anything but exactly one data field parses as a message.
    odd = pb.ResultChunk(data=b"ab").SerializeToString() + b"\x12\x01c"
    assert tensors.parse_chunk(odd).data == b"c"  # the last value of a field wins
    with pytest.raises(ValueError, match="did not start with its skeleton"):
        tensors.read_result(received[1:])


def test_result_stream_of_small_values_is_one_message() -> None:
    chunks = _result_stream((np.ones(3), 2.0))
    assert len(chunks) == 1
    got = tensors.read_result(chunks)
    np.testing.assert_array_equal(got[0], np.ones(3))
    assert got[1] == 2.0


def test_data_prefixes_make_messages_protobuf_parses() -> None:
    with pytest.raises(ValueError, match=r"nonnegative int\. Got -1"):
        tensors.varint(-1)
    assert [tensors.varint(n) for n in (0, 127, 128, 300)] == [b"\x00", b"\x7f", b"\x80\x01",
                                                               b"\xac\x02"]
    for n in (0, 1, 127, 128, 70_000):
        body = bytes(range(256)) * (n // 256) + bytes(n % 256)
        message = tensors.DATA_PIECES.prefix(n) + body
        assert pb.ResultChunk.FromString(message).data == body
