"""The job store and the job state machine: real SQLite files under tmp_path, no mocks."""

from __future__ import annotations

import collections
import itertools
import json
import math
import pickle
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from jaxpod.errors import JobNotFoundError
from jaxpod.service.jobs.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    Allocating,
    Cancelled,
    Failed,
    IllegalTransitionError,
    JobState,
    Pending,
    Retrying,
    Running,
    Succeeded,
    Suspended,
    check_transition,
)
from jaxpod.service.jobs.store import (
    INLINE_PAYLOAD_LIMIT,
    MAX_AUDIT_DETAIL,
    RESTART_REASON,
    JobStore,
    JobStoreError,
    Transition,
)
from jaxpod.service.jobs.store_database import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SchemaVersionError,
    migrate,
)

S = JobState


class Clock:
    """Deterministic time: 1000.0, 1001.0, ... one second per reading."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return 1000.0 + next(self._ticks)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with JobStore(tmp_path / "state", clock=Clock()) as s:
        yield s


def _run_to(store: JobStore, job_id: str, *path: Any) -> None:
    for state in path:
        store.transition(job_id, state)


# --------------------------------------------------------------------------- states

def test_transition_table_is_the_design_one() -> None:
    expected = {
        (S.PENDING, S.ALLOCATING), (S.PENDING, S.CANCELLED),
        (S.ALLOCATING, S.RUNNING), (S.ALLOCATING, S.FAILED), (S.ALLOCATING, S.CANCELLED),
        (S.ALLOCATING, S.RETRYING),  # the coordinator restarted while it allocated
        (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLED),
        (S.RUNNING, S.RETRYING),
        (S.RETRYING, S.ALLOCATING), (S.RETRYING, S.FAILED), (S.RETRYING, S.CANCELLED),
        # a job of higher priority took its slice: it waits in the queue again
        (S.ALLOCATING, S.PENDING), (S.RUNNING, S.PENDING), (S.RETRYING, S.PENDING),
        # job.suspend() (a running job checkpoints first), then job.resume() or cancel
        (S.PENDING, S.SUSPENDED), (S.ALLOCATING, S.SUSPENDED), (S.RUNNING, S.SUSPENDED),
        (S.RETRYING, S.SUSPENDED), (S.SUSPENDED, S.PENDING), (S.SUSPENDED, S.CANCELLED),
    }
    for old, new in itertools.product(S, S):
        if (old, new) in expected:
            check_transition(old, new)
        else:
            with pytest.raises(IllegalTransitionError, match=f"{old.value} -> {new.value}"):
                check_transition(old, new)
    assert {s for s in S if not TRANSITIONS[s]} == TERMINAL_STATES
    assert {S.SUCCEEDED, S.FAILED, S.CANCELLED} == TERMINAL_STATES


def test_illegal_transition_message_says_why() -> None:
    with pytest.raises(IllegalTransitionError, match=r"SUCCEEDED is terminal.*submit a new job"):
        check_transition(S.SUCCEEDED, S.RUNNING)
    with pytest.raises(IllegalTransitionError, match="allowed from there: ALLOCATING, CANCELLED"):
        check_transition(S.PENDING, S.RUNNING)


def test_state_classes_carry_their_names_and_data() -> None:
    instances = [Pending(3), Allocating(1), Running(1, 7), Retrying(2, "host lost"),
                 Suspended("suspended by user"), Succeeded(), Failed("boom"),
                 Cancelled("user")]
    assert [i.state for i in instances] == list(S)
    assert Running(attempt=1, step=7).step == 7
    with pytest.raises(AttributeError):
        Running(1, 7).step = 8  # type: ignore[misc]
    assert JobState.parse("running") is S.RUNNING
    with pytest.raises(ValueError, match="Unknown job state 'DONE'; expected one of PENDING"):
        JobState.parse("DONE")


# --------------------------------------------------------------------------- jobs

def test_create_and_get_round_trip(store: JobStore) -> None:
    job = store.create_job(steps=10, payload=b"\x00pickled", accelerator_type="v4-16",
                           job_id="j1")
    assert job == store.get("j1")
    assert (job.id, job.name, job.accelerator_type, job.steps) == ("j1", "j1", "v4-16", 10)
    assert (job.state, job.step, job.error, job.attempts) == (S.PENDING, 0, None, 0)
    assert (job.queue_position, job.metrics, job.goodput, job.steps_per_s) == (
        None, {}, None, None)
    assert (job.created_at, job.started_at, job.finished_at) == (1000.0, None, None)
    assert store.load_payload("j1") == b"\x00pickled"
    named = store.create_job(steps=1, payload=b"", name="nightly")
    assert named.name == "nightly" and len(named.id) == 12 and named.id != "j1"
    assert store.load_payload(named.id) == b""


def test_large_payload_lives_in_a_file_under_the_job_dir(store: JobStore) -> None:
    payload = bytes(range(256)) * (INLINE_PAYLOAD_LIMIT // 256 + 1)
    store.create_job(steps=1, payload=payload, job_id="big")
    assert (store.state_dir / "jobs" / "big" / "payload.bin").read_bytes() == payload
    assert store.load_payload("big") == payload
    with sqlite3.connect(store.path) as conn:
        row = conn.execute("SELECT payload, payload_path FROM jobs WHERE id = 'big'").fetchone()
    assert row == (None, "jobs/big/payload.bin")


def test_bad_job_input_is_refused_and_writes_nothing(store: JobStore) -> None:
    with pytest.raises(JobStoreError, match="payload must be bytes; got dict"):
        store.create_job(steps=1, payload={"fn": object()}, job_id="x")  # type: ignore[arg-type]
    with pytest.raises(JobStoreError, match="steps must be an int >= 1; got 0"):
        store.create_job(steps=0, payload=b"", job_id="x")
    assert store.list() == []


def test_unknown_job_id_is_a_typed_error_that_says_how_to_list(store: JobStore) -> None:
    for call in (store.get, store.history, store.metrics, store.logs, store.load_result,
                 store.load_payload, store.attempts, store.record_attempt):
        with pytest.raises(JobNotFoundError) as info:
            call("nope")
        assert "'nope'" in str(info.value) and "jaxpod jobs" in str(info.value)
        assert isinstance(info.value, KeyError)
    with pytest.raises(JobNotFoundError):
        store.transition("nope", Allocating(1))
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is JobNotFoundError and str(copy) == str(info.value)
    assert copy.job_id == "nope"


# --------------------------------------------------------------------------- transitions

def test_every_transition_is_recorded_with_time_and_reason(store: JobStore) -> None:
    store.create_job(steps=100, payload=b"", job_id="j")            # t=1000
    _run_to(store, "j", Allocating(1), Running(1, 0))                # t=1001, 1002
    running = store.transition("j", Retrying(1, "slice preempted"))  # t=1003
    assert running.state is S.RETRYING
    _run_to(store, "j", Allocating(2), Running(2, 40))               # t=1004, 1005
    done = store.transition("j", Succeeded(), reason="all steps ran")  # t=1006
    assert (done.state, done.step, done.started_at, done.finished_at) == (
        S.SUCCEEDED, 40, 1002.0, 1006.0)
    assert store.history("j") == [
        Transition(None, S.PENDING, 1000.0, "submitted"),
        Transition(S.PENDING, S.ALLOCATING, 1001.0, ""),
        Transition(S.ALLOCATING, S.RUNNING, 1002.0, ""),
        Transition(S.RUNNING, S.RETRYING, 1003.0, "slice preempted"),
        Transition(S.RETRYING, S.ALLOCATING, 1004.0, ""),
        Transition(S.ALLOCATING, S.RUNNING, 1005.0, ""),
        Transition(S.RUNNING, S.SUCCEEDED, 1006.0, "all steps ran"),
    ]


def test_failure_and_cancellation_keep_their_error_and_reason(store: JobStore) -> None:
    store.create_job(steps=1, payload=b"", job_id="f")
    store.create_job(steps=1, payload=b"", job_id="c")
    _run_to(store, "f", Allocating(1), Running(1, 0))
    failed = store.transition("f", Failed("ValueError: bad batch\nTraceback ..."))
    assert failed.error == "ValueError: bad batch\nTraceback ..."
    assert store.history("f")[-1].reason == failed.error
    cancelled = store.transition("c", Cancelled("cancelled by the user"))
    assert (cancelled.state, cancelled.error, cancelled.finished_at) == (  # who cancelled
        S.CANCELLED, "cancelled by the user", 1005.0)
    assert store.history("c")[-1] == Transition(S.PENDING, S.CANCELLED, 1005.0,
                                                "cancelled by the user")


@pytest.mark.parametrize(("path", "illegal"), [
    ((Allocating(1), Running(1, 5), Succeeded()), Running(1, 6)),
    ((), Running(1, 0)),
    ((Cancelled("user"),), Allocating(1)),
    ((Allocating(1), Running(1, 2)), Allocating(2)),
])
def test_illegal_transition_is_refused_and_writes_nothing(
        store: JobStore, path: tuple[Any, ...], illegal: Any) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    _run_to(store, "j", *path)
    before, history = store.get("j"), store.history("j")
    with pytest.raises(IllegalTransitionError, match=f"-> {illegal.state.value}"):
        store.transition("j", illegal)
    assert store.get("j") == before
    assert store.history("j") == history


# --------------------------------------------------------------------------- attempts

def test_attempts_round_trip(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    assert store.record_attempt("j") == 1                   # t=1001
    store.end_attempt("j", 1, cause="preempted", step_reached=4)  # t=1002
    assert store.record_attempt("j") == 2                   # t=1003
    assert store.get("j").attempts == 2
    attempts = store.attempts("j")
    assert [(a.number, a.started_at, a.ended_at, a.cause, a.step_reached) for a in attempts] == [
        (1, 1001.0, 1002.0, "preempted", 4), (2, 1003.0, None, None, None)]
    with pytest.raises(JobStoreError, match="Attempt 1 of job 'j' has already ended"):
        store.end_attempt("j", 1, cause="again", step_reached=5)
    with pytest.raises(JobStoreError, match="Attempt 3 of job 'j' was never started"):
        store.end_attempt("j", 3, cause="x", step_reached=0)
    assert store.attempts("j") == attempts


def test_the_first_loop_of_each_attempt_is_timed_once(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    store.record_attempt("j")                               # t=1001
    assert store.attempts("j")[0].first_step_at is None
    store.first_loop_done("j")                              # t=1002
    store.first_loop_done("j")                              # t=1003: kept at 1002
    store.end_attempt("j", 1, cause="preempted", step_reached=4)
    store.record_attempt("j")
    store.first_loop_done("j")
    assert [a.first_step_at for a in store.attempts("j")] == [1002.0, 1006.0]


# --------------------------------------------------------------------------- metrics, logs

def test_metrics_round_trip(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    store.add_metrics("j", 5, {"loss": 0.5, "acc": np.float32(0.25)})
    store.add_metrics("j", 10, {"loss": math.nan, "acc": math.inf})
    assert store.get("j").step == 10
    series = store.metrics("j")
    assert set(series) == {"loss", "acc"}
    assert series["acc"] == [(5, 0.25), (10, math.inf)]
    assert series["loss"][0] == (5, 0.5)
    assert series["loss"][1][0] == 10 and math.isnan(series["loss"][1][1])
    # A resumed attempt redoing step 5 replaces its values instead of failing.
    store.add_metrics("j", 5, {"loss": 0.75})
    assert store.metrics("j")["loss"][0] == (5, 0.75)
    assert store.get("j").step == 5


def test_latest_metrics_are_each_series_last_point(store: JobStore) -> None:
    store.create_job(steps=100, payload=b"", job_id="j")
    store.create_job(steps=100, payload=b"", job_id="other")
    assert store.latest_metrics("j") == {}
    rng = np.random.default_rng(0)
    for step in range(1, 60):
        # Series recorded at different steps; names sort around each other.
        values = {name: float(rng.normal()) for name in ("loss", "acc", "a", "zz")
                  if step % (len(name) + 1) == 0}
        store.add_metrics("j", step, values)
        store.add_metrics("other", step, {"loss": float(step), "b": 1.0})
    store.add_metrics("j", 3, {"loss": 7.0, "new": math.nan})  # a redone step
    expected = {name: points[-1][1] for name, points in store.metrics("j").items()}
    latest = store.latest_metrics("j")
    assert latest.keys() == expected.keys() == {"loss", "acc", "a", "zz", "new"}
    assert math.isnan(latest.pop("new")) and math.isnan(expected.pop("new"))
    assert latest == expected
    assert store.latest_metrics("other") == {"loss": 59.0, "b": 1.0}
    # Following the job: the points after a step are the tail of each full series.
    full = store.metrics("j")
    for after in (-1, 0, 3, 30, 58, 59):
        tail = {name: [(step, v) for step, v in points if step > after]
                for name, points in full.items()}
        got = store.metrics("j", after=after)
        assert got.keys() == {k for k, v in tail.items() if v}
        for name, points in got.items():
            assert [p[0] for p in points] == [p[0] for p in tail[name]]
            np.testing.assert_array_equal([p[1] for p in points], [p[1] for p in tail[name]])
    with pytest.raises(JobNotFoundError):
        store.latest_metrics("nope")


def _record(store: JobStore, job_id: str, steps: list[int],
            names: tuple[str, ...] = ("loss",)) -> None:
    """Metrics of a long job, each step's value its index, written in one transaction
    through a connection of its own (add_metrics writes a step per transaction)."""
    store.create_job(steps=max(steps, default=0) + 1, payload=b"", job_id=job_id)
    with sqlite3.connect(store.path) as conn:
        conn.executemany("INSERT INTO metrics (job_id, name, step, value) VALUES (?, ?, ?, ?)",
                         [(job_id, name, step, float(i)) for name in names
                          for i, step in enumerate(steps)])


@pytest.mark.parametrize("n", [0, 1, 2, 5, 1999, 2000, 2001, 4000, 123_457])
@pytest.mark.parametrize("at_most", [0, 1, 2, 3, 2000])
def test_thinned_series_keep_their_ends_evenly_spaced(store: JobStore, n: int,
                                                      at_most: int) -> None:
    points = [(10 * i, float(i)) for i in range(n)]
    _record(store, "j", [step for step, _ in points])
    got = store.metrics("j", points=at_most).get("loss", [])
    if at_most == 0 or n <= at_most:
        assert got == points
        return
    assert len(got) == at_most and got[-1] == points[-1]
    if at_most > 1:
        assert got[0] == points[0]
        steps = np.array([s for s, _ in got])
        # The first point at or after each evenly spaced step (numpy's own search).
        all_steps = np.array([s for s, _ in points])
        ticks = 0 + (all_steps[-1] - 0) * np.arange(at_most) // (at_most - 1)
        np.testing.assert_array_equal(steps, all_steps[np.searchsorted(all_steps, ticks)])
        gaps = np.diff(steps)
        # Evenly spaced: the gaps differ by at most one original point (10 steps).
        assert gaps.min() > 0 and gaps.max() - gaps.min() <= 10
        assert all(v == s / 10 for s, v in got)  # each step with its own value


def test_thinned_series_follow_their_own_steps_after_a_step(store: JobStore) -> None:
    # Series recorded at different steps, one only near the start; a gap in the middle.
    steps = [*range(0, 3000, 3), *range(9000, 12000, 3)]
    _record(store, "j", steps, names=("a", "loss"))
    _record(store, "early", list(range(10)))
    store.add_metrics("j", 12_005, {"rare": 1.0})
    store.add_metrics("j", 12_010, {"rare": 2.0})
    for after in (-1, 0, 2999, 5000, 11_997, 12_005, 12_010):
        full = store.metrics("j", after=after)
        got = store.metrics("j", after=after, points=100)
        assert got.keys() == full.keys()
        for name, points in got.items():
            assert len(points) <= 100
            assert points[0] == full[name][0] and points[-1] == full[name][-1]
            assert set(points) <= set(full[name]) and points == sorted(points)
            if len(full[name]) <= 100:
                assert points == full[name]
    assert store.metrics("j", points=1) == {"a": [(11_997, 1999.0)], "loss": [(11_997, 1999.0)],
                                            "rare": [(12_010, 2.0)]}
    assert store.metrics("early", points=1000) == store.metrics("early")
    with pytest.raises(ValueError, match=r"points must be >= 0.*got -1"):
        store.metrics("j", points=-1)


def test_a_thinned_read_costs_its_points_not_the_jobs_length(tmp_path: Path) -> None:
    """SQLite's own count of the instructions a read runs (a progress handler called
    every 100): a thinned read of a job 100 times longer runs about as many, where a
    whole read runs about 100 times as many."""
    with JobStore(tmp_path) as store:
        for job_id, steps in (("short", 1_000), ("long", 100_000)):
            _record(store, job_id, list(range(steps)), names=("acc", "loss"))

        def instructions(job_id: str, points: int) -> int:
            ticks = [0]

            def count() -> int:
                ticks[0] += 1
                return 0  # go on

            store._conn.set_progress_handler(count, 100)
            try:
                store.metrics(job_id, points=points)
            finally:
                store._conn.set_progress_handler(None, 100)
            return ticks[0]

        assert instructions("long", 0) > 50 * instructions("short", 0)  # the counter counts
        for points in (1, 500):
            assert instructions("long", points) < 2 * instructions("short", points) + 10


def test_a_failed_metrics_write_lands_nothing(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    store.add_metrics("j", 1, {"loss": 1.0})
    # The step and "loss" are written before "acc" fails inside the same transaction.
    with pytest.raises(JobStoreError, match=r"Metric 'acc' must be a real number.*got str"):
        store.add_metrics("j", 2, {"loss": 0.5, "acc": "high"})
    with pytest.raises(JobStoreError, match="got ndarray"):
        store.add_metrics("j", 2, {"loss": 0.5, "vec": np.ones(3)})
    assert store.metrics("j") == {"loss": [(1, 1.0)]}
    assert store.get("j").step == 1


def test_logs_round_trip_and_tail(store: JobStore) -> None:
    store.create_job(steps=1, payload=b"", job_id="j")
    store.append_logs("j", 0, ["epoch 1", "loss 0.5"])   # t=1001
    store.append_logs("j", 1, ["host one says hi"])      # t=1002
    lines = store.logs("j")
    assert [(ln.host, ln.line, ln.at) for ln in lines] == [
        (0, "epoch 1", 1001.0), (0, "loss 0.5", 1001.0), (1, "host one says hi", 1002.0)]
    assert [ln.line for ln in store.logs("j", after=lines[1].seq)] == ["host one says hi"]


# --------------------------------------------------------------------------- results

def _assert_same_tree(got: Any, want: Any) -> None:
    # The store keeps trees as the wire carries them: a numpy scalar as a 0-d array.
    if isinstance(want, np.generic):
        want = np.asarray(want)
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same_tree(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_tree(g, w)
    elif isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want, strict=True)
    else:
        assert got == want


def test_result_round_trip_keeps_values_dtypes_and_structure(store: JobStore) -> None:
    store.create_job(steps=1, payload=b"", job_id="j")
    rng = np.random.default_rng(0)
    state = {
        "params": {"w": rng.standard_normal((3, 4)).astype(np.float32),
                   "b": np.arange(4, dtype=np.float16)},
        "opt": [np.array(7, dtype=np.int64), (np.uint8(255), None)],
        "mask": np.array([True, False]),
        "z": np.array([1 + 2j], dtype=np.complex64),
        "empty": np.zeros((0, 2), dtype=np.int8),
    }
    outputs = {"loss": np.float32(0.125), "per_class": np.array([0.5, 0.25]), "n": 3,
               "tree": state}
    path = store.save_result("j", outputs)
    assert path == store.state_dir / "jobs" / "j" / "result.npz"
    result = store.load_result("j")
    assert result is not None
    _assert_same_tree(result.outputs, outputs)
    # Plain numpy can read the file (no pickle needed).
    with np.load(path, allow_pickle=False) as npz:
        assert "__tree__" in npz.files
        assert any(np.array_equal(npz[f], state["params"]["w"]) for f in npz.files
                   if f.startswith("leaf_"))


class _Pair(NamedTuple):
    first: Any
    second: Any


def test_frozen_pytrees_and_other_keys_round_trip(store: JobStore) -> None:
    """What a worker sends frozen (a NamedTuple, a typed key) and dicts keyed by ints,
    tuples and floats are stored as the wire carries them, and thaw to the same
    values; bfloat16 arrays keep their dtype."""
    import jax
    import ml_dtypes

    from jaxpod import trees

    store.create_job(steps=1, payload=b"", job_id="j")
    key = jax.random.key(7)
    state = {"pair": _Pair(np.arange(3, dtype=np.float32), {0: np.int32(1)}),
             "key": key, "half": np.ones(2, ml_dtypes.bfloat16),
             (1, "a"): np.zeros(1), 2.5: np.ones(1)}
    store.save_result("j", trees.freeze(state))
    result = store.load_result("j")
    assert result is not None
    back = trees.thaw(result.outputs)
    assert type(back["pair"]) is _Pair
    np.testing.assert_array_equal(back["pair"].first, state["pair"].first)
    assert back["pair"].second == {0: np.int32(1)}
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(key))
    assert back["half"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back[(1, "a")], np.zeros(1))
    np.testing.assert_array_equal(back[2.5], np.ones(1))


def test_a_result_that_cannot_be_stored_writes_nothing(store: JobStore) -> None:
    store.create_job(steps=1, payload=b"", job_id="j")
    assert store.load_result("j") is None
    bad_trees = [{"w": np.ones(2), "x": np.array([object()])},
                 {"w": np.ones(2), "fn": print}]
    for bad in bad_trees:
        with pytest.raises(JobStoreError, match="Cannot store the job's result"):
            store.save_result("j", bad)
    assert store.load_result("j") is None
    assert not (store.state_dir / "jobs" / "j").exists()


def test_checkpoint_rows_follow_what_the_hosts_keep(tmp_path: Path) -> None:
    """The rows are exactly the steps last recorded; a row kept keeps its time."""
    times = iter(range(100, 200))
    with JobStore(tmp_path, clock=lambda: float(next(times))) as store:
        _checkpoint_rows(store)


def _checkpoint_rows(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"", job_id="j")
    assert store.checkpoints("j") == [] and store.state_skeleton("j") is None
    store.set_checkpoints("j", {4: "/c/j/4/state"}, {4: 0.5})
    store.set_checkpoints("j", {4: "/c/j/4/state", 8: "/c/j/8/state"}, {8: 0.25})
    # read back from storage (no stalls known): the rows keep theirs
    store.set_checkpoints("j", {8: "/c/j/8/state", 12: "/c/j/12/state"})
    got = store.checkpoints("j")
    assert [(c.step, c.path) for c in got] == [(8, "/c/j/8/state"), (12, "/c/j/12/state")]
    assert got[0].saved_at < got[1].saved_at  # 8's row was written before 12's
    assert [c.stall_s for c in got] == [0.25, None]
    store.set_checkpoints("j", {})
    assert store.checkpoints("j") == []
    store.set_state_skeleton("j", b"\x01\x02")
    assert store.state_skeleton("j") == b"\x01\x02"
    with pytest.raises(JobNotFoundError):
        store.set_checkpoints("nope", {1: "x"})


# --------------------------------------------------------------------------- readers

def test_a_second_store_sees_committed_writes(store: JobStore) -> None:
    store.create_job(steps=10, payload=b"p", job_id="j")
    with JobStore(store.state_dir) as other:
        assert other.get("j").state is S.PENDING
        store.transition("j", Allocating(1))
        store.add_metrics("j", 3, {"loss": 2.0})
        assert other.get("j").state is S.ALLOCATING      # no reopen needed
        assert other.metrics("j") == {"loss": [(3, 2.0)]}
        other.transition("j", Running(1, 3))
    assert store.get("j").state is S.RUNNING
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from jaxpod.service.jobs.states import Succeeded
    from jaxpod.service.jobs.store import JobStore
    with JobStore(Path(sys.argv[1])) as store:
        job = store.get("j")
        seen = {"state": job.state.value, "step": job.step,
                "spec": store.load_payload("j").decode(),
                "metrics": store.metrics("j"),
                "history": [t.to_state.value for t in store.history("j")],
                "result": store.load_result("j").outputs}
        store.transition("j", Succeeded(), reason="child")
    print(json.dumps(seen))
""")


def test_another_process_reads_what_this_one_committed(store: JobStore) -> None:
    store.create_job(steps=4, payload=b"the spec", job_id="j")
    _run_to(store, "j", Allocating(1), Running(1, 0))
    store.add_metrics("j", 4, {"loss": 0.5})
    store.save_result("j", {"loss": 0.5})
    # This store stays open (its connection holds the WAL) while the child reads.
    child = subprocess.run([sys.executable, "-c", _CHILD, str(store.state_dir)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen == {"state": "RUNNING", "step": 4, "spec": "the spec",
                    "metrics": {"loss": [[4, 0.5]]},
                    "history": ["PENDING", "ALLOCATING", "RUNNING"],
                    "result": {"loss": 0.5}}
    assert store.get("j").state is S.SUCCEEDED
    assert store.history("j")[-1].reason == "child"


# --------------------------------------------------------------------------- recovery

def test_recover_requeues_unfinished_jobs_and_moves_in_flight_ones_to_retrying(
        tmp_path: Path) -> None:
    with JobStore(tmp_path, clock=Clock()) as store:
        paths: dict[str, tuple[Any, ...]] = {
            "p1": (), "alloc": (Allocating(1),), "p2": (),
            "run": (Allocating(1), Running(1, 7)),
            "retry": (Allocating(1), Running(1, 3), Retrying(1, "host lost")),
            "done": (Allocating(1), Running(1, 0), Succeeded()),
            "gone": (Cancelled("user"),), "p3": (),
        }
        for job_id, path in paths.items():
            store.create_job(steps=10, payload=b"", job_id=job_id)
            if path:
                store.record_attempt(job_id)
            _run_to(store, job_id, *path)
        before = {j: store.get(j) for j in ("done", "gone")}
    with JobStore(tmp_path, clock=Clock()) as restarted:
        recovery = restarted.recover()
        assert [j.id for j in recovery.requeue] == ["p1", "alloc", "p2", "run", "retry", "p3"]
        assert [j.id for j in recovery.resumed] == ["alloc", "run"]
        for job, was in zip(recovery.resumed, ["ALLOCATING", "RUNNING"], strict=True):
            assert job == restarted.get(job.id)
            assert job.state is S.RETRYING and job.finished_at is None
            last = restarted.history(job.id)[-1]
            assert (last.from_state, last.to_state, last.reason) == (
                S[was], S.RETRYING, RESTART_REASON)
            assert restarted.attempts(job.id)[-1].cause == RESTART_REASON
        assert restarted.attempts("run")[-1].step_reached == 7
        assert restarted.get("retry").state is S.RETRYING  # waiting already: unchanged
        assert {j: restarted.get(j) for j in ("done", "gone")} == before
        again = restarted.recover()
        assert again.resumed == ()
        assert [j.id for j in again.requeue] == ["p1", "alloc", "p2", "run", "retry", "p3"]


# --------------------------------------------------------------------------- schema

def test_a_database_from_a_newer_jaxpod_is_refused(tmp_path: Path) -> None:
    JobStore(tmp_path).close()
    db = tmp_path / "jobs.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaVersionError) as info:
        JobStore(tmp_path)
    message = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert f"versions up to {SCHEMA_VERSION}" in message
    assert "Upgrade jaxpod" in message and "--state-dir" in message
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == (
            SCHEMA_VERSION + 1)


def test_a_version_1_database_is_migrated_with_its_jobs(tmp_path: Path) -> None:
    assert SCHEMA_VERSION >= 2 and len(MIGRATIONS) == SCHEMA_VERSION
    conn = sqlite3.connect(tmp_path / "jobs.sqlite", isolation_level=None)
    conn.execute("BEGIN")
    assert migrate(conn, target=1) == 0
    conn.execute("INSERT INTO jobs (id, name, spec, payload, created_at, state, step, steps) "
                 "VALUES ('old', 'old', '{\"steps\": 3}', x'00', 10.0, 'SUCCEEDED', 3, 3)")
    conn.executemany(
        "INSERT INTO transitions (job_id, from_state, to_state, at, reason) VALUES (?,?,?,?,?)",
        [("old", None, "PENDING", 10.0, "submitted"), ("old", "PENDING", "ALLOCATING", 11.0, ""),
         ("old", "ALLOCATING", "RUNNING", 12.0, ""), ("old", "RUNNING", "SUCCEEDED", 15.0, "")])
    conn.execute("COMMIT")
    columns = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
    assert "started_at" not in columns
    conn.close()
    # The spec is kept once, in the payload: v5 drops the JSON copy.
    with JobStore(tmp_path) as store:
        old = store.get("old")
        assert (old.state, old.step, store.load_payload("old")) == (S.SUCCEEDED, 3, b"\x00")
        assert (old.created_at, old.started_at, old.finished_at) == (10.0, 12.0, 15.0)
        assert [t.to_state for t in store.history("old")][-1] is S.SUCCEEDED
        new = store.create_job(steps=1, payload=b"", job_id="new")
        assert new.started_at is None
        assert [j.id for j in store.list(state="SUCCEEDED")] == ["old"]
    with sqlite3.connect(tmp_path / "jobs.sqlite") as check:
        assert check.execute("SELECT version FROM schema_version").fetchone()[0] == (
            SCHEMA_VERSION)
        assert "spec" not in {r[1] for r in check.execute("PRAGMA table_info(jobs)")}


def test_a_version_2_database_is_migrated_with_its_rows(tmp_path: Path) -> None:
    assert SCHEMA_VERSION >= 3
    conn = sqlite3.connect(tmp_path / "jobs.sqlite", isolation_level=None)
    conn.execute("BEGIN")
    assert migrate(conn, target=2) == 0
    conn.execute("INSERT INTO jobs (id, name, spec, payload, created_at, state, step, steps, "
                 "started_at, finished_at) VALUES ('old', 'old', '{}', x'00', 10.0, "
                 "'SUCCEEDED', 3, 3, 12.0, 15.0)")
    conn.execute("INSERT INTO transitions (job_id, from_state, to_state, at, reason) "
                 "VALUES ('old', NULL, 'PENDING', 10.0, 'submitted')")
    conn.execute("INSERT INTO attempts (job_id, number, started_at, ended_at, cause, "
                 "step_reached) VALUES ('old', 1, 12.0, 15.0, 'succeeded', 3)")
    conn.execute("INSERT INTO metrics (job_id, name, step, value) VALUES ('old', 'loss', 3, 0.5)")
    conn.execute("COMMIT")
    assert "goodput" not in {r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    with JobStore(tmp_path) as store:
        old = store.get("old")
        assert (old.state, old.step, old.started_at, old.finished_at, old.attempts) == (
            S.SUCCEEDED, 3, 12.0, 15.0, 1)
        assert store.metrics("old") == {"loss": [(3, 0.5)]}
        assert store.attempts("old")[0].cause == "succeeded"
        assert store.goodput("old") == {}  # the new table, empty for old jobs
        store.set_goodput("old", {"queued": 2.0, "productive": 3.0})
        assert store.goodput("old") == {"queued": 2.0, "productive": 3.0}
    with sqlite3.connect(tmp_path / "jobs.sqlite") as check:
        assert check.execute("SELECT version FROM schema_version").fetchone()[0] == (
            SCHEMA_VERSION)


def test_reopening_a_current_database_keeps_its_data(tmp_path: Path) -> None:
    with JobStore(tmp_path) as store:
        store.create_job(steps=1, payload=b"x", job_id="j")
    with JobStore(tmp_path) as store:
        assert store.load_payload("j") == b"x"
        assert len(store.history("j")) == 1


# --------------------------------------------------------------------------- listing

def test_list_orders_by_creation_filters_and_pages(tmp_path: Path) -> None:
    # One timestamp for all and ids in reverse order: only creation order sorts them.
    with JobStore(tmp_path, clock=lambda: 5.0) as store:
        for job_id in ["e", "d", "c", "b", "a"]:
            store.create_job(steps=1, payload=b"", job_id=job_id)
        store.transition("d", Allocating(1))
        store.transition("b", Allocating(1))
        assert [j.id for j in store.list()] == ["e", "d", "c", "b", "a"]
        assert [j.id for j in store.list(state=S.ALLOCATING)] == ["d", "b"]
        assert [j.id for j in store.list(state="pending")] == ["e", "c", "a"]
        assert [j.id for j in store.list(limit=2)] == ["e", "d"]
        assert [j.id for j in store.list(limit=2, offset=2)] == ["c", "b"]
        assert [j.id for j in store.list(limit=2, offset=4)] == ["a"]
        assert [j.id for j in store.list(state="PENDING", limit=1, offset=1)] == ["c"]
        assert store.list(state=S.SUCCEEDED) == []
        # Counts come from one query; they match counting the listed jobs.
        listed = collections.Counter(j.state.value for j in store.list())
        assert store.counts() == {s.value: listed.get(s.value, 0) for s in S}
        with pytest.raises(ValueError, match="Unknown job state 'DONE'"):
            store.list(state="DONE")
        with pytest.raises(JobStoreError, match="limit and offset must be >= 0"):
            store.list(offset=-1)


def test_the_audit_log_pages_back_and_keeps_its_newest_records(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("jaxpod.service.jobs.store.MAX_AUDIT_RECORDS", 5)
    monkeypatch.setattr("jaxpod.service.jobs.store.AUDIT_TRIM_EVERY", 2)
    for i in range(1, 13):
        store.record_audit(f"who{i}", "submit", f"job{i}", "x" * 5000)
    kept = store.audit(limit=100)
    # Trimmed at the 12th append to seq > 12 - 5: the newest five, oldest first.
    assert [r.seq for r in kept] == [8, 9, 10, 11, 12]
    assert [r.target for r in kept] == [f"job{i}" for i in range(8, 13)]
    assert all(len(r.detail) == MAX_AUDIT_DETAIL < 5000 for r in kept)  # details are cut
    assert [r.seq for r in store.audit(limit=2)] == [11, 12]
    assert [r.seq for r in store.audit(limit=2, before=11)] == [9, 10]
    assert [r.at for r in kept] == sorted(r.at for r in kept)
