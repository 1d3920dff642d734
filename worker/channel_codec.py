"""An operation channel's messages as bytes and back.

Messages are pickles (protocol 5), made by the standard C pickler, which takes half
the time of cloudpickle for an operation's message (about 15 against 30 µs), and by
cloudpickle only where it fails: a class or function that must travel by value, such
as a user's exception class the worker loaded by value. The C pickler refuses any
class or function it cannot find as itself by name, so it never sends by name what
cloudpickle would send by value, bar a ``__main__``'s own, which the service's and the
worker's (jaxpod's entry points) never put in a message. Large buffers (numpy arrays)
travel out of band, each received straight into its own buffer (see
:mod:`~jaxpod.worker.channel_io`). :class:`~jaxpod.pieces.Streamed` buffers (a view
of gathered rows) travel out of band too; the receiving end may take each in pieces
of its own layout, every piece received straight into its own ``bytes`` object behind
a prefix it writes (:class:`~jaxpod.pieces.PieceLayout`), so neither end copies or
frames them.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import cloudpickle

from jaxpod.pieces import Streamed

#: Buffers at least this large travel out of band (no copy into the pickle).
OUT_OF_BAND_BYTES = 64 * 1024
#: A message's header: the pickle's length, the number of out-of-band buffers: pickle's
#: own, then Streamed ones (their sizes follow).
HEADER = struct.Struct("<QQQ")


class _OutOfBand:
    """Takes large buffers and :class:`Streamed` ones out of the pickle, so that they
    travel out of band, as they are. Mixed into a pickler class. A Streamed buffer is
    pickled as a call of :func:`_streamed_slot` with its index, which the receiving
    :class:`_Unpickler` resolves to the buffer it received. That is done in
    ``reducer_override``, which the C pickler calls only for objects of types without
    a fast path of their own; a ``persistent_id`` would be called for every object, a
    Python call per string and int that made encoding a 1000-leaf state's infos take
    three times as long."""

    def __init__(self, file: io.BytesIO, buffers: list[Any]) -> None:
        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
                return True  # in band
            buffers.append(buffer.raw())
            return False

        super().__init__(file, protocol=5, buffer_callback=out_of_band)  # type: ignore[call-arg]
        self.streamed: list[Streamed] = []

    def _slot(self, obj: Streamed) -> tuple[Any, tuple[int]]:
        self.streamed.append(obj)
        return _streamed_slot, (len(self.streamed) - 1,)


class _Pickler(_OutOfBand, pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return self._slot(obj) if type(obj) is Streamed else NotImplemented


class _CloudPickler(_OutOfBand, cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Streamed:
            return self._slot(obj)
        return super().reducer_override(obj)


def _streamed_slot(index: int) -> Any:
    """Stands for a message's Streamed buffer number ``index``: only a receiving
    :class:`_Unpickler` calls it, as the buffer it received."""
    raise RuntimeError(f"Streamed buffer {index} was unpickled outside the channel.")


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: Any, buffers: list[Any], streamed: list[Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._streamed = streamed

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _streamed_slot.__name__:
            return self._streamed.__getitem__
        return super().find_class(module, name)


def encode(message: Any) -> tuple[bytes, list[Any]]:
    """The message's header and pickle; then what travels out of band, in order:
    pickle's buffers (memoryviews) and :class:`Streamed` buffers' data. Raises whatever
    cloudpickle raises, before anything is sent."""
    try:
        return _encode(message, _Pickler)
    except Exception:  # something only cloudpickle takes (see the module's docstring)
        return _encode(message, _CloudPickler)


def _encode(message: Any, pickler_class: type[_Pickler] | type[_CloudPickler]
            ) -> tuple[bytes, list[Any]]:
    buffers: list[Any] = []
    file = io.BytesIO()
    pickler = pickler_class(file, buffers)
    pickler.dump(message)
    data = file.getvalue()
    streamed = [s.data for s in pickler.streamed]
    sizes = [b.nbytes for b in buffers] + [s.nbytes for s in streamed]
    header = (HEADER.pack(len(data), len(buffers), len(streamed))
              + struct.pack(f"<{len(sizes)}Q", *sizes))
    return header + data, buffers + streamed


def decode(data: Any, buffers: list[Any], streamed: int) -> Any:
    """Unpickles a received message; its last ``streamed`` buffers were Streamed."""
    if not streamed:
        return pickle.loads(data, buffers=buffers)
    split = len(buffers) - streamed
    return _Unpickler(data, buffers[:split], buffers[split:]).load()


class Decoded:
    """Decodes the replies of one operation, each distinct one once: hosts in lockstep
    answer alike (the same value ids and shapes), and unpickling every host's copy
    cost the coordinator the hosts times the reply's size per operation (a 1000-leaf
    state from 256 hosts: half a second). A reply equal to the one before it, byte
    for byte, is the same object; replies with out-of-band buffers are always decoded
    (comparing them would cost as much)."""

    def __init__(self) -> None:
        self._last: tuple[bytearray, Any] | None = None

    def __call__(self, data: bytearray, buffers: list[Any], streamed: int) -> Any:
        if buffers:
            return decode(data, buffers, streamed)
        if self._last is not None and self._last[0] == data:
            return self._last[1]
        value = decode(data, buffers, streamed)
        self._last = (data, value)
        return value
