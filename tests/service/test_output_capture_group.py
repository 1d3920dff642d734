"""What a step function prints on each host of a real 2-host slice comes back per host.

Real host workers on a simulated v4-16 (2 hosts x 4 chips): ``print`` at trace time and
``jax.debug.print`` at run time, each naming the host that printed it.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpod.service.group_engine import GroupEngine

CLUSTER_SLICES = "v4-16"
HOSTS, LOCAL_REPLICAS = 2, 4


def _step(x: jax.Array) -> jax.Array:
    print(f"tracing on host {jax.process_index()}")
    jax.debug.print("host {h} ran with total {t}", h=jax.process_index(), t=x.sum())
    return x + 1


def test_each_hosts_printed_lines_come_back_separately(group: GroupEngine) -> None:
    group.capture_output(True)
    try:
        out = group.run(_step, args=(np.arange(4, dtype=np.float32),))
        group.gather(out, axis=0)  # waits until every host ran it
        taken = group.take_output()
    finally:
        group.capture_output(False)
    assert taken == [[f"tracing on host {h}"] + [f"host {h} ran with total 6.0"]
                     * LOCAL_REPLICAS for h in range(HOSTS)]
    assert group.take_output() == [[], []]

    out = group.run(_step, args=(np.arange(4, dtype=np.float32),))  # not capturing
    group.gather(out, axis=0)
    assert group.take_output() == [[], []]
