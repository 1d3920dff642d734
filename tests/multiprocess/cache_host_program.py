"""One simulated host of two: compiles one program over both hosts' devices with the
persistent compilation cache on and prints what :mod:`jaxpod.worker.compile_cache`
counted. Arguments: coordinator address, process id, ``writes`` (every process
writes its entries) or ``first-writes`` (JAX's rule alone)."""

from __future__ import annotations

import json
import sys

address, process_id, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jaxpod.worker import compile_cache  # noqa: E402

compile_cache.enable(every_process_writes=mode == "writes")
jax.distributed.initialize(address, num_processes=2, process_id=process_id,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((4,), ("data",))
rows = np.arange(32, dtype=np.float32).reshape(8, 4)
x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("data")),
                                 lambda index: rows[index])
total = jax.jit(lambda a: (a * 3.0).sum(axis=0),
                out_shardings=NamedSharding(mesh, P()))(x)
loaded, compiled = compile_cache.programs() or (-1, -1)
print(json.dumps({"process": process_id, "loaded": loaded, "compiled": compiled,
                  "total": np.asarray(total.addressable_data(0)).tolist()}), flush=True)
jax.distributed.shutdown()
