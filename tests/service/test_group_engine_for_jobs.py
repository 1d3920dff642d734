"""What the job runner asks of a real 2-host slice besides running steps.

Real host workers on a simulated v4-16 (2 hosts x 4 chips): what a step function prints
on each host comes back per host (``print`` at trace time and ``jax.debug.print`` at run
time, each naming the host that printed it), and one replica's copy of a value comes
from the one host holding it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpod import operations as ops
from jaxpod.service.slices.group_engine import GroupEngine


@pytest.fixture(scope="module")
def group(process_group: GroupEngine) -> GroupEngine:
    """This module's v4-16: hosts as plain processes (what it tests does not depend on
    how they were started, and no Ray cluster need start for it)."""
    return process_group


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


def _state(x: jax.Array) -> dict[str, object]:
    import jaxpod

    ctx = jaxpod.get_replica_context()
    assert ctx is not None
    return {"w": x * (ctx.replica_id_in_sync_group + 1), "n": ctx.replica_id_in_sync_group}


def test_one_replicas_value_comes_from_the_host_holding_it(group: GroupEngine) -> None:
    x = np.arange(3, dtype=np.float32)
    state = group.run(_state, args=(x,))
    replicas = group.local_results(state)
    for replica in (0, 5):  # one on each host
        got = group.replica_value(state, replica)
        np.testing.assert_array_equal(got["w"], replicas[replica]["w"])
        np.testing.assert_array_equal(got["w"], x * (replica + 1))
        assert int(got["n"]) == replica
    # Only the holder answers with data; the other host sends nothing.
    answers = group.group.call(ops.ReplicaValue(group.handles(state), 5))
    assert answers[0] is None and answers[1] is not None
    with pytest.raises(ValueError, match=r"replica must be in \[0, 8\)"):
        group.replica_value(state, 8)
