"""The in-process strategy over N simulated devices, in a process of its own.

The test process has 8 simulated devices (JAX fixes the count when its backend
starts), so comparisons with slices of more replicas ask this process instead.

Usage: ``python inprocess_oracle.py NUM_DEVICES``. It reads requests from stdin and
answers on stdout, each a 4-byte big-endian length and a pickle: a request is an
``input_cases.Case``, its answer ``("ok", observe(strategy, case))`` or
``("error", traceback text)``. It exits when stdin closes.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
from typing import IO, Any

_LENGTH = struct.Struct(">I")


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or ``None`` once the stream has ended."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(header)
    return pickle.loads(stream.read(n))


def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def main(num_devices: int) -> None:
    # Answers go to a private copy of stdout; anything printed (JAX's warnings, a
    # step function's prints) goes to stderr and cannot corrupt them.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import jax

    jax.config.update("jax_num_cpu_devices", num_devices)
    jax.config.update("jax_platforms", "cpu")
    import input_cases

    import jaxpod

    assignment = jaxpod.DeviceAssignment.build(jax.devices()[:num_devices])
    strategy = jaxpod.TPUStrategy(device_assignment=assignment)
    while (case := read_message(sys.stdin.buffer)) is not None:
        try:
            write_message(answers, ("ok", input_cases.observe(strategy, case)))
        except Exception:
            write_message(answers, ("error", traceback.format_exc()))


if __name__ == "__main__":
    main(int(sys.argv[1]))
