"""The whole documented TPUStrategy surface (``../shared/reference/``), on every backend.

Member names are read from the five reference documents; each must exist on the
in-process and the remote strategies (1 and 2 hosts). The semantics are checked
against numpy, and the documents' code samples run ported to JAX.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_np_reference import ATOL, RTOL, tf_rebatch

import jaxpod

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
_IDENT = r"[a-z_][a-z0-9_]*"


def _lines(name: str) -> list[str]:
    return (REFERENCE / name).read_text().splitlines()


def _headings(lines: list[str]) -> set[str]:
    """Unindented lines that hold nothing but a name (the TF1 docs' section headings;
    indented ones are arguments of a signature)."""
    return {s for s in (line.rstrip() for line in lines) if re.fullmatch(_IDENT, s)}


def reference_members() -> dict[str, set[str]]:
    """Each reference file's public members, parsed from its text."""
    members: dict[str, set[str]] = {}
    # TF1 contrib docs: one heading per property and method ("Properties", "Methods").
    tf1 = _lines("tf1-contrib-TPUStrategy-api.txt")
    start = tf1.index("Properties")
    members["tf1-contrib-TPUStrategy-api.txt"] = _headings(tf1[start:])
    # tf.distribute.Strategy 1.x: properties as headings, methods as qualified headings.
    strat = _lines("tf-distribute-Strategy-api.txt")
    start = strat.index("Properties")
    members["tf-distribute-Strategy-api.txt"] = _headings(strat[start:]) | {
        m.group(1) for line in strat
        if (m := re.fullmatch(rf"tf\.distribute\.Strategy\.({_IDENT}|__deepcopy__)", line))}
    # TF1 source: public methods and properties of the class.
    src = _lines("tf1-contrib-tpu_strategy.py.txt")
    members["tf1-contrib-tpu_strategy.py.txt"] = {
        m.group(1) for line in src[src.index("class TPUStrategy(one_device_strategy."
                                             "OneDeviceStrategy):"):]
        if (m := re.match(r"  def ([a-z][a-z0-9_]*)\(self", line))} | {"steps_per_run"}
    # TF2 docs: a method heading is followed by "View source"; properties open lines
    # of the table after the constructor's arguments.
    for name in ("tf2-TPUStrategy-api.txt", "tf2-experimental-TPUStrategy-api.txt"):
        lines = [s.strip() for s in _lines(name) if s.strip()]
        methods = {a for a, b in itertools.pairwise(lines)
                   if b == "View source" and re.fullmatch(_IDENT, a)}
        props = {p for p in ("cluster_resolver", "extended", "num_replicas_in_sync")
                 if any(s.startswith(p + " ") for s in lines)}
        members[name] = methods | props
    return members


#: Every member the five reference files name (the union of ``reference_members()``;
#: the first test checks the two agree wherever the files are present). From
#: tf1-contrib-TPUStrategy-api.txt and tf1-contrib-tpu_strategy.py.txt: the tower
#: members, ``distribute_dataset``, ``run_steps_on_dataset``, update/colocation, the
#: graph-only ones; tf-distribute-Strategy-api.txt: ``experimental_run``, the iterator
#: makers, ``experimental_initialize``/``finalize``, ``update_config_proto``,
#: ``__deepcopy__``, ``extended``; tf2-*-TPUStrategy-api.txt: TF2's methods.
EXPECTED_MEMBERS = {
    "batch_reduce", "between_graph", "broadcast", "call_for_each_tower", "cluster_resolver",
    "colocate_vars_with", "configure", "distribute_dataset",
    "distribute_datasets_from_function", "experimental_assign_to_logical_device",
    "experimental_distribute_dataset", "experimental_distribute_values_from_function",
    "experimental_finalize", "experimental_initialize", "experimental_local_results",
    "experimental_replicate_to_logical_devices", "experimental_run",
    "experimental_split_to_logical_devices", "extended", "finalize", "gather",
    "get_host_cpu_device", "group", "initialize", "is_single_tower",
    "make_dataset_iterator", "make_input_fn_iterator", "map", "non_slot_devices",
    "num_hosts", "num_replicas_in_sync", "num_towers", "num_towers_per_host",
    "parameter_devices", "read_var", "reduce", "run", "run_steps_on_dataset", "scope",
    "should_checkpoint", "should_init", "should_save_summary", "steps_per_run", "unwrap",
    "update", "update_config_proto", "update_non_slot", "value_container",
    "worker_device_index", "worker_devices", "__deepcopy__",
}
#: TF2's StrategyExtended members the issue names (plus those TF1 had on the strategy).
EXTENDED_MEMBERS = (
    "experimental_between_graph", "parameter_devices", "worker_devices", "steps_per_run",
    "call_for_each_replica", "reduce_to", "batch_reduce_to", "broadcast_to", "update",
    "value_container", "colocate_vars_with", "update_non_slot", "non_slot_devices",
    "read_var", "experimental_run_steps_on_iterator", "experimental_should_init",
    "should_checkpoint", "should_save_summary", "experimental_require_static_shapes",
)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"no reference folder at {REFERENCE}")
def test_the_reference_files_name_these_members() -> None:
    found = set().union(*reference_members().values())
    assert found == EXPECTED_MEMBERS


def test_every_reference_member_exists(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    # Properties are evaluated, so they must work too (on remote, over the service).
    missing = [m for m in sorted(EXPECTED_MEMBERS) if not hasattr(strategy, m)]
    assert not missing
    missing_ext = [m for m in EXTENDED_MEMBERS if not hasattr(strategy.extended, m)]
    assert not missing_ext


#: jaxpod's own documented additions to TF's surface (README, DESIGN §3).
ADDITIONS = {"run_steps", "spmd"}
#: What TF keeps behind ``strategy.extended`` and jaxpod's engine keeps there too.
MACHINERY = ("gather_parts", "padded_parts", "replica_value", "next_steps",
             "allgather_json", "allgather_host", "num_local_replicas")


def test_the_strategy_shows_tf_s_surface_and_keeps_its_machinery_behind_extended() -> None:
    public = {n for n in dir(jaxpod.TPUStrategy) if not n.startswith("_")}
    tf_members = {m for m in EXPECTED_MEMBERS if not m.startswith("_")}
    assert public - tf_members - ADDITIONS == set(), "not TF's, nor a documented addition"
    # TF's members missing from the class are the instance attributes it sets
    assert tf_members - public == {"cluster_resolver", "num_hosts", "steps_per_run"}
    strategy = jaxpod.TPUStrategy()
    for name in MACHINERY:
        assert not hasattr(strategy, name), name
        assert hasattr(strategy.extended, name), name
    assert strategy.extended.num_local_replicas == strategy.num_replicas_in_sync


def unwrap_np(strategy: Any, value: Any) -> list[Any]:
    return [np.asarray(v) for v in strategy.unwrap(value)]


# ------------------------------------------------------------------ towers
def test_tower_properties(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    assert strategy.num_towers == strategy.num_replicas_in_sync == 2
    assert strategy.num_towers_per_host == 2 // strategy.num_hosts
    assert strategy.is_single_tower is False
    assert strategy.between_graph is False
    assert strategy.should_init and strategy.should_checkpoint and strategy.should_save_summary
    ext = strategy.extended
    assert ext.experimental_between_graph is False
    assert ext.experimental_require_static_shapes is True
    assert ext.steps_per_run == strategy.steps_per_run
    assert strategy_of(2, steps_per_run=3).extended.steps_per_run == 3
    one = strategy_of(1)
    assert one.is_single_tower and one.num_towers == 1


def test_devices(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    devices = strategy.worker_devices
    assert len(devices) == 2 and len(set(devices)) == 2
    per_host = 2 // strategy.num_hosts
    for r, name in enumerate(devices):
        m = re.fullmatch(r"/job:worker/replica:0/task:(\d+)/device:(CPU|GPU|TPU):(\d+)", name)
        assert m, name
        assert int(m.group(1)) == r // per_host  # replicas sit on hosts in order
    assert strategy.parameter_devices == devices == strategy.extended.worker_devices
    assert strategy.non_slot_devices([]) == devices
    assert strategy.get_host_cpu_device(strategy.num_hosts - 1) == (
        f"/job:worker/replica:0/task:{strategy.num_hosts - 1}/device:CPU:0")
    with pytest.raises(ValueError, match=r"host_id must be an int in \[0, "):
        strategy.get_host_cpu_device(strategy.num_hosts)


def test_worker_device_index_example(strategy_of: Callable[..., Any]) -> None:
    """TF1's example: ``call_for_each_tower(fn, worker_device_index)`` gives each
    tower its index into ``worker_devices``."""
    strategy = strategy_of(2)
    with strategy.scope():
        def fn(device_id: jax.Array) -> jax.Array:
            return device_id * 10

        out = strategy.call_for_each_tower(fn, strategy.worker_device_index)
    assert [int(v) for v in unwrap_np(strategy, out)] == [0, 10]


def test_call_for_each_tower_merge_example(strategy_of: Callable[..., Any]) -> None:
    """TF1's ``call_for_each_tower`` example: ``v = 3 + tower_id``; the merge sums ``v``
    over towers; each tower returns ``s + v``. merge_call becomes ``all_reduce``."""
    strategy = strategy_of(2)

    def fn(three: int) -> jax.Array:
        ctx = jaxpod.get_replica_context()
        v = three + ctx.replica_id_in_sync_group
        s = ctx.all_reduce("SUM", v)
        return s + v

    with strategy.scope():
        merged = strategy.call_for_each_tower(fn, 3, run_concurrently=True)
    s = sum(3 + r for r in range(2))
    assert [int(v) for v in unwrap_np(strategy, merged)] == [s + 3 + r for r in range(2)]
    # TF2's spelling through extended.
    again = strategy.extended.call_for_each_replica(fn, args=(3,))
    assert [int(v) for v in unwrap_np(strategy, again)] == [s + 3 + r for r in range(2)]


# ------------------------------------------------------------ cross-replica
def test_batch_reduce_equals_separate_reduces(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(2)]
    a = strategy.experimental_distribute_values_from_function(lambda c: parts[0][
        c.replica_id_in_sync_group])
    b = strategy.experimental_distribute_values_from_function(lambda c: parts[1][
        c.replica_id_in_sync_group] * 2)
    for op in ("SUM", "MEAN", "MAX"):
        got = strategy.batch_reduce(op, [(a, None), (b, strategy.worker_devices)])
        want = [strategy.reduce(op, a, axis=None), strategy.reduce(op, b, axis=None)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=RTOL)
    np.testing.assert_allclose(strategy.batch_reduce("SUM", [(a, a)])[0], parts[0].sum(0),
                               rtol=RTOL, atol=ATOL)
    first = strategy.batch_reduce("ONLY_FIRST_TOWER", [(b, None)])[0]
    np.testing.assert_allclose(first, parts[1][0] * 2)
    np.testing.assert_allclose(strategy.extended.reduce_to("MEAN", a, a), parts[0].mean(0),
                               rtol=RTOL, atol=ATOL)
    ext = strategy.extended.batch_reduce_to("MIN", [(a, None), (b, None)])
    np.testing.assert_allclose(ext[1], (parts[1] * 2).min(0))
    with pytest.raises(ValueError, match="not devices of this strategy"):
        strategy.batch_reduce("SUM", [(a, "/job:worker/task:99/device:TPU:0")])
    # TF1's reduce(aggregation, value, destinations).
    host = strategy.get_host_cpu_device(0)
    np.testing.assert_allclose(strategy.reduce("SUM", a, host), parts[0].sum(0), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(strategy.reduce("MEAN", b, destinations=b),
                               (parts[1] * 2).mean(0), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(strategy.reduce("ONLY_FIRST_TOWER", b, strategy.worker_devices),
                               parts[1][0] * 2)
    with pytest.raises(ValueError, match=r"axis must be an int or None\. Got '/device:TPU:99'"):
        strategy.reduce("SUM", a, "/device:TPU:99")
    with pytest.raises(ValueError, match="not devices of this strategy"):
        strategy.reduce("SUM", a, destinations="/device:TPU:99")


def test_broadcast_gives_every_replica_the_value(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    x = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(1.5)}
    mirrored = strategy.broadcast(x)
    for got in strategy.unwrap(mirrored):
        np.testing.assert_array_equal(got["w"], x["w"])
        np.testing.assert_array_equal(got["b"], x["b"])
    to = strategy.extended.broadcast_to(x["w"], strategy.worker_devices)
    assert all(np.array_equal(v, x["w"]) for v in unwrap_np(strategy, to))
    with pytest.raises(TypeError, match="not a PerReplica value"):
        strategy.broadcast(mirrored)


def test_update_returns_updated_mirrored_values(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    w0 = np.array([1.0, 2.0], np.float32)
    var = strategy.broadcast({"w": w0})
    lr = np.float32(0.5)

    def sgd(v: dict[str, jax.Array], grad: jax.Array, lr: jax.Array) -> dict[str, jax.Array]:
        return {"w": v["w"] - lr * grad}

    grad = np.array([2.0, -2.0], np.float32)
    new = strategy.update(var, sgd, grad, lr=lr)
    for got in strategy.unwrap(new):
        np.testing.assert_allclose(got["w"], w0 - lr * grad)
    np.testing.assert_allclose(strategy.read_var(new)["w"], w0 - lr * grad)
    lists = strategy.update(var, sgd, grad, lr=lr, grouped=False)
    assert len(lists["w"]) == 2
    np.testing.assert_allclose(lists["w"][1], w0 - lr * grad)
    ext = strategy.extended.update(var, sgd, args=(grad,), kwargs={"lr": lr})
    np.testing.assert_allclose(strategy.read_var(ext)["w"], w0 - lr * grad)
    # Non-slot values (e.g. Adam's beta powers) are mirrored like the others.
    beta = strategy.broadcast(np.float32(0.9))
    power = strategy.update_non_slot(strategy.non_slot_devices([var]), lambda b: b * b, beta)
    assert [float(v) for v in unwrap_np(strategy, power)] == pytest.approx([0.81, 0.81])
    ext_power = strategy.extended.update_non_slot(None, lambda b: b + 1, args=(beta,),
                                                  group=False)
    assert [float(v) for v in ext_power] == pytest.approx([1.9, 1.9])


def test_colocate_vars_with_example(strategy_of: Callable[..., Any]) -> None:
    """TF1's example: var2 and var3 made inside ``colocate_vars_with(var1)``, then
    ``update(var1, fn, var2, var3)`` runs ``fn`` wherever var1 is."""
    strategy = strategy_of(2)
    with strategy.scope():
        var1 = strategy.broadcast(np.float32(1.0))
        with strategy.colocate_vars_with(var1), strategy.extended.colocate_vars_with(var1):
            var2 = strategy.broadcast(np.float32(2.0))
            var3 = strategy.broadcast(np.float32(3.0))

        def fn(v1: jax.Array, v2: jax.Array, v3: jax.Array) -> jax.Array:
            return v1 + v2 * v3

        out = strategy.update(var1, fn, var2, var3)
    assert [float(v) for v in unwrap_np(strategy, out)] == [7.0, 7.0]


def test_unwrap_value_container_read_var_group(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda c: np.full((2,), c.replica_id_in_sync_group, np.float32))
    parts = unwrap_np(strategy, value)
    assert isinstance(strategy.unwrap(value), list)
    np.testing.assert_array_equal(np.stack(parts), [[0, 0], [1, 1]])
    assert strategy.value_container(value) is value
    assert strategy.extended.value_container(value) is value
    np.testing.assert_array_equal(strategy.read_var(value), [0, 0])  # replica 0's copy
    np.testing.assert_array_equal(strategy.extended.read_var(value), [0, 0])
    assert strategy.unwrap(np.float32(3.0)) == [np.float32(3.0)]
    assert strategy.group({"a": value, "b": [value]}) is None
    short = next(iter(strategy.experimental_distribute_dataset([rows(1)])))  # valid [1, 0]
    assert strategy.group([value, short, strategy.run(lambda x: x * 2, args=(short,))]) is None
    assert strategy.group(np.ones(2)) is None


def test_map_one_value_per_replica(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    out = strategy.map([np.float32(1), np.float32(2)], lambda m, k: m * k, np.float32(3))
    assert [float(v) for v in unwrap_np(strategy, out)] == [3.0, 6.0]
    with pytest.raises(ValueError, match=r"one value per replica \(2\); got 3"):
        strategy.map([1, 2, 3], lambda m: m)


# ------------------------------------------------------------------ inputs
def rows(n: int, features: int = 2, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n * features, dtype=np.float32).reshape(n, features)


def test_experimental_run_and_make_dataset_iterator(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    data = [rows(3), rows(3, start=100), rows(1, start=200)]  # a short last batch
    expected = tf_rebatch(data, 3, 2)
    it = strategy.make_dataset_iterator(data)
    assert it.initialize() == []

    def double(x: jax.Array) -> jax.Array:
        return x * 2.0

    for want in expected:
        out = strategy.experimental_run(double, it)
        for got, w in zip(unwrap_np(strategy, out), want, strict=True):
            np.testing.assert_array_equal(got, w * 2.0)
    with pytest.raises(StopIteration):
        strategy.experimental_run(lambda x: x, it)
    it.initialize()  # starts over
    np.testing.assert_array_equal(unwrap_np(strategy, it.get_next())[0], expected[0][0])
    no_input = strategy.experimental_run(lambda: jnp.float32(4.0))
    assert [float(v) for v in unwrap_np(strategy, no_input)] == [4.0, 4.0]


def test_make_input_fn_iterator_example(strategy_of: Callable[..., Any]) -> None:
    """TF 1.x's example: ``from_tensors([[1.]]).repeat()`` sharded by input pipeline,
    fed to ``extended.call_for_each_replica``."""
    strategy = strategy_of(2)

    def input_fn(input_context: jaxpod.InputContext) -> Any:
        d = itertools.repeat(np.array([[1.0]], np.float32))
        return itertools.islice(d, input_context.input_pipeline_id, None,
                                input_context.num_input_pipelines)

    def replica_fn(x: jax.Array) -> jax.Array:
        return x + jaxpod.get_replica_context().replica_id_in_sync_group

    with strategy.scope():
        iterator = strategy.make_input_fn_iterator(input_fn)
        results = strategy.extended.call_for_each_replica(replica_fn,
                                                          args=(iterator.get_next(),))
    assert [float(v.ravel()[0]) for v in unwrap_np(strategy, results)] == [1.0, 2.0]
    with pytest.raises(ValueError, match="PER_WORKER"):
        strategy.make_input_fn_iterator(input_fn, replication_mode="PER_REPLICA")
    assert jaxpod.InputReplicationMode.PER_WORKER.name == "PER_WORKER"


def test_distribute_dataset_example(strategy_of: Callable[..., Any]) -> None:
    """TF1's example: ``dataset_fn`` returns ``from_tensors([[1.]]).repeat()``; a
    one-shot iterator feeds ``call_for_each_tower``."""
    strategy = strategy_of(2)

    def dataset_fn() -> Any:
        return itertools.repeat(np.array([[1.0]], np.float32))

    def tower_fn(x: jax.Array) -> jax.Array:
        return x * 3.0

    with strategy.scope():
        distributed_dataset = strategy.distribute_dataset(dataset_fn)
        iterator = distributed_dataset.make_one_shot_iterator()
        tower_results = strategy.call_for_each_tower(tower_fn, iterator.get_next())
    assert all(np.array_equal(v, [[3.0]]) for v in unwrap_np(strategy, tower_results))


def test_distribute_dataset_gives_each_tower_the_next_element(
        strategy_of: Callable[..., Any]) -> None:
    """Replica ``r`` of step ``s`` takes element ``s * R + r`` on one host or several."""
    strategy = strategy_of(2)
    elements = [rows(1, start=10 * i) for i in range(5)]  # 3 steps, the last short
    dist = strategy.distribute_dataset(lambda: elements)
    steps = list(dist.make_initializable_iterator())
    assert len(steps) == 3
    got = [[v for v in unwrap_np(strategy, s)] for s in steps]
    for s in range(2):
        for r in range(2):
            np.testing.assert_array_equal(got[s][r], elements[2 * s + r])
    np.testing.assert_array_equal(got[2][0], elements[4])
    assert got[2][1].shape == (0, 2)  # past the end: no rows
    with pytest.raises(TypeError, match="dataset_fn must be a callable"):
        strategy.distribute_dataset(elements)


# ---------------------------------------------------------- run_steps_on_dataset
def test_run_steps_on_dataset_equals_steps_by_run(strategy_of: Callable[..., Any]) -> None:
    """Over a partial last batch: the last step's outputs equal those of the same
    step by ``run``, reduced as each ``reduce_op`` says."""
    strategy = strategy_of(2)
    data = [rows(3), rows(3, start=100), rows(3, start=200), rows(1, start=300)]
    expected = tf_rebatch(data, 3, 2)  # 4 steps; the last has one row in all

    def per_replica(x: jax.Array) -> dict[str, jax.Array]:
        ctx = jaxpod.get_replica_context()
        masked = jnp.where(ctx.valid_row_mask[:, None], x, 0.0)
        return {"loss": jnp.sum(masked), "top": jnp.max(masked), "y": x + 1.0}

    def step_fn(context: jaxpod.MultiStepContext, x: jax.Array) -> None:
        out = per_replica(x)
        context.set_last_step_output("loss", out["loss"], "SUM")
        context.set_last_step_output("mean_loss", out["loss"], jaxpod.ReduceOp.MEAN)
        context.set_last_step_output("top", out["top"], "MAX")
        context.set_last_step_output("first", out["loss"], "ONLY_FIRST_TOWER")
        context.set_last_step_output("y", out["y"])
        context.set_non_tensor_output("note", {"steps": "many"})

    by_run = [strategy.run(per_replica, args=(b,))
              for b in strategy.experimental_distribute_dataset(data)]
    iterator = strategy.make_dataset_iterator(data)
    for end in (2, 3):  # 3 steps, then the 1 that remains
        ctx = strategy.run_steps_on_dataset(step_fn, iterator, iterations=3)
        assert isinstance(ctx, jaxpod.MultiStepContext)
        assert ctx.run_op is None
        out = ctx.last_step_outputs
        assert set(out) == {"loss", "mean_loss", "top", "first", "y"}
        want = by_run[end]
        np.testing.assert_allclose(out["loss"], strategy.reduce("SUM", want["loss"]),
                                   rtol=RTOL)
        np.testing.assert_allclose(out["mean_loss"], strategy.reduce("MEAN", want["loss"]),
                                   rtol=RTOL)
        np.testing.assert_allclose(out["top"], strategy.reduce("MAX", want["top"]))
        np.testing.assert_allclose(out["first"], unwrap_np(strategy, want["loss"])[0])
        # numpy: the rows TF's rebatching gives that step.
        np.testing.assert_allclose(out["loss"], sum(p.sum() for p in expected[end]),
                                   rtol=RTOL)
        assert isinstance(out["y"], jaxpod.PerReplica)
        for got, w in zip(unwrap_np(strategy, out["y"]), expected[end], strict=True):
            np.testing.assert_allclose(got, w + 1.0)
        assert ctx.non_tensor_outputs == {"note": {"steps": "many"}}
    with pytest.raises(jaxpod.EndOfDataError):
        strategy.run_steps_on_dataset(step_fn, iterator, iterations=3)


def test_run_steps_on_dataset_tf1_idioms(strategy_of: Callable[..., Any]) -> None:
    """TF1 steps call ``call_for_each_tower`` and unpack tuple elements; loop values
    carry from step to step; ``extended`` has it as ``experimental_run_steps_on_iterator``."""
    strategy = strategy_of(2)
    xs = [rows(2, start=10 * i) for i in range(4)]
    data = [(x, x[:, :1] * 0 + i) for i, x in enumerate(xs)]

    def tower_fn(x: jax.Array, label: jax.Array) -> jax.Array:
        return jnp.sum(x) + jnp.sum(label)

    def step_fn(context: jaxpod.MultiStepContext, x: jax.Array, label: jax.Array) -> None:
        total = strategy.call_for_each_tower(tower_fn, x, label)
        context.set_last_step_output("total", total, "SUM")

    it = iter(strategy.experimental_distribute_dataset(data))
    ctx = strategy.run_steps_on_dataset(step_fn, it, iterations=2,
                                        initial_loop_values={"total": np.float32(0)})
    np.testing.assert_allclose(ctx.last_step_outputs["total"], xs[1].sum() + 1 * 2)
    ctx = strategy.extended.experimental_run_steps_on_iterator(step_fn, it, iterations=1)
    np.testing.assert_allclose(ctx.last_step_outputs["total"], xs[2].sum() + 2 * 2)
    # A step that reports nothing still runs (and takes its input).
    quiet = strategy.run_steps_on_dataset(lambda context, x, label: None, it)
    assert quiet.last_step_outputs == {} and quiet.non_tensor_outputs == {}
    bad = {"total": np.zeros((3,), np.float32)}
    with pytest.raises(TypeError, match="initial_loop_values must have the shapes"):
        strategy.run_steps_on_dataset(step_fn, iter(strategy.experimental_distribute_dataset(
            data)), iterations=1, initial_loop_values=bad)
    with pytest.raises(ValueError, match=r"iterations must be a positive int\. Got 0"):
        strategy.run_steps_on_dataset(step_fn, it, iterations=0)


def test_multi_step_context_errors() -> None:
    ctx = jaxpod.MultiStepContext()
    with pytest.raises(TypeError, match=r"name must be a str\. Got 3"):
        ctx.set_last_step_output(3, 1.0)
    with pytest.raises(ValueError, match=r"reduce_op must be None .* Got 'AVG'"):
        ctx.set_last_step_output("x", 1.0, "AVG")


# ------------------------------------------------------------- graph-only
def test_graph_only_members_do_the_honest_thing(strategy_of: Callable[..., Any]) -> None:
    strategy = strategy_of(2)
    config = {"isolate_session_state": False}
    assert strategy.configure(session_config=config) is None
    assert config == {"isolate_session_state": False}  # nothing claimed, nothing changed
    updated = strategy.update_config_proto(config)
    assert updated == config and updated is not config
    for method in (strategy.initialize, strategy.finalize, strategy.experimental_initialize,
                   strategy.experimental_finalize):
        assert method() == []
    assert copy.deepcopy(strategy) is strategy
    assert copy.deepcopy({"s": strategy})["s"] is strategy


# --------------------------------------------------- TF2 samples with extended
def test_values_from_function_worker_devices_example(strategy_of: Callable[..., Any]) -> None:
    """TF2's ``experimental_distribute_values_from_function`` example 4: one value per
    ``extended.worker_devices`` entry, picked by replica id."""
    strategy = strategy_of(2)
    worker_devices = strategy.extended.worker_devices
    multiple_values = [np.float32(1.0 + i) for i in range(strategy.num_replicas_in_sync)]
    assert len(worker_devices) == len(multiple_values)

    def value_fn(ctx: jaxpod.ValueContext) -> np.float32:
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    assert [float(v) for v in unwrap_np(strategy, distributed_values)] == [1.0, 2.0]


def test_experimental_distribute_dataset_example(strategy_of: Callable[..., Any]) -> None:
    """TF2's example: ``range(4).batch(2)`` over 2 replicas, ``input * 2``."""
    strategy = strategy_of(2)
    dataset = [np.arange(4, dtype=np.int64)[i:i + 2] for i in (0, 2)]
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    result = [strategy.run(lambda x: x * 2, args=(x,)) for x in dist_dataset]
    assert [[v.tolist() for v in unwrap_np(strategy, r)] for r in result] == [
        [[0], [2]], [[4], [6]]]


def test_custom_training_loop_example(strategy_of: Callable[..., Any]) -> None:
    """TF2's TPUStrategy example: a Dense(2) layer on 5 features trained by SGD(0.1)
    on batches of 1 from ``distribute_datasets_from_function``; each replica's
    gradients are summed over replicas (what ``apply_gradients`` does in a replica
    context). The dataset is not sharded, so every host's replicas read it from the
    start, as in TF. Cross-entropy from logits stands in for Keras's loss."""
    strategy = strategy_of(2)
    with strategy.scope():  # model and optimizer: mirrored parameters
        rng = np.random.default_rng(7)
        params = strategy.broadcast({"kernel": rng.normal(size=(5, 2)).astype(np.float32),
                                     "bias": np.zeros((2,), np.float32)})
        learning_rate = np.float32(0.1)

    def dataset_fn(ctx: jaxpod.InputContext) -> Any:
        data_rng = np.random.default_rng(0)  # the same data on every host
        x = data_rng.random((2, 5)).astype(np.float32)
        y = data_rng.integers(2, size=(2, 1)).astype(np.int32)
        batches = [(x[i:i + 1], y[i:i + 1]) for i in range(2)]  # batch(1, drop_remainder)
        return itertools.chain.from_iterable(itertools.repeat(batches))  # repeat()

    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(dist_dataset)

    def step_fn(params: Any, inputs: Any) -> Any:
        features, labels = inputs

        def loss_fn(p: Any) -> jax.Array:
            logits = features @ p["kernel"] + p["bias"]
            log_probs = jax.nn.log_softmax(logits)
            return -jnp.sum(jnp.take_along_axis(log_probs, labels, axis=1))

        grads = jax.grad(loss_fn)(params)
        grads = jaxpod.get_replica_context().all_reduce("SUM", grads)
        return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

    def train_step(params: Any, iterator: Any) -> Any:
        return strategy.run(step_fn, args=(params, next(iterator)))

    # numpy: replica r on host h reads element (step * k + r - h * k) % 2 of its host's copy.
    data_rng = np.random.default_rng(0)
    x = data_rng.random((2, 5)).astype(np.float32)
    y = data_rng.integers(2, size=(2, 1))
    w = {k: np.asarray(v) for k, v in strategy.read_var(params).items()}
    k = strategy.num_towers_per_host
    for step in range(3):
        params = train_step(params, iterator)
        gw, gb = np.zeros_like(w["kernel"]), np.zeros_like(w["bias"])
        for r in range(2):
            i = (step * k + r % k) % 2
            logits = x[i:i + 1] @ w["kernel"] + w["bias"]
            p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            d = p - np.eye(2)[y[i]]
            gw += x[i:i + 1].T @ d
            gb += d[0]
        w = {"kernel": w["kernel"] - 0.1 * gw, "bias": w["bias"] - 0.1 * gb}
        for replica in strategy.unwrap(params):
            np.testing.assert_allclose(replica["kernel"], w["kernel"], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(replica["bias"], w["bias"], rtol=1e-4, atol=1e-5)


def test_scope_example(strategy_of: Callable[..., Any]) -> None:
    """TF2's ``scope`` example: a value made in scope is mirrored on every replica."""
    strategy = strategy_of(2)
    with strategy.scope():
        assert jaxpod.get_strategy() is strategy
        mirrored_variable = strategy.broadcast(np.float32(1.0))
    assert [float(v) for v in unwrap_np(strategy, mirrored_variable)] == [1.0, 1.0]
    regular_variable = np.float32(1.0)
    assert strategy.unwrap(regular_variable) == [1.0]


def test_tf1_constructor_num_cores() -> None:
    """TF1's ``TPUStrategy(tpu_cluster_resolver, steps_per_run, num_cores)``."""
    strategy = jaxpod.TPUStrategy("local", 4, num_cores=2)
    assert (strategy.num_towers, strategy.steps_per_run, strategy.cluster_resolver) == (
        2, 4, "local")
    with pytest.raises(ValueError, match=r"num_cores must be an int in \[1, 8\].*Got 9"):
        jaxpod.TPUStrategy(num_cores=9)
    with pytest.raises(ValueError, match="not both"):
        jaxpod.TPUStrategy(num_cores=2, device_assignment=jaxpod.DeviceAssignment.build())


def test_tf2_constructor_names() -> None:
    """TF2's ``TPUStrategy(tpu_cluster_resolver, experimental_device_assignment,
    experimental_spmd_xla_partitioning)``."""
    da = jaxpod.DeviceAssignment.build(jax.devices()[:2])
    strategy = jaxpod.TPUStrategy(tpu_cluster_resolver="local",
                                  experimental_device_assignment=da)
    assert (strategy.cluster_resolver, strategy.num_replicas_in_sync) == ("local", 2)
    x = np.ones(2, np.float32)
    assert strategy.experimental_assign_to_logical_device(x, 0) is x
    spmd = jaxpod.TPUStrategy(experimental_device_assignment=da,
                              experimental_spmd_xla_partitioning=True)
    with pytest.raises(ValueError, match="experimental_spmd_xla_partitioning=True"):
        spmd.experimental_assign_to_logical_device(x, 0)
    with pytest.raises(ValueError, match="not both"):
        jaxpod.TPUStrategy("local", tpu_cluster_resolver="local")
