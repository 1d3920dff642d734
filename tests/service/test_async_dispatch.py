"""Asynchronous dispatch of the remote strategy, against a real ``jaxpod serve``
holding a 2-host v4-16 (8 replicas) and a v4-8.

A call whose outputs the client can predict returns its handles before the service
answers; a failure raises at the next synchronising call with the user's exception
and a note naming the call and where it was made; the operations that used its
outputs are not run; the strategy goes on computing right answers (numpy decides).
"""

from __future__ import annotations

import gc
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import PROCESSES, Service, running_service

import jaxpod
from jaxpod.client.remote import RemoteStrategy

REPLICAS = 8
_SERIALS = itertools.count()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("async") / "serve.log", "v4-16,v4-8",
                         args=PROCESSES) as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected


@pytest.fixture
def strategy(client: Any) -> Iterator[RemoteStrategy]:
    with client.strategy("v4-16", timeout_s=120) as held:
        yield held


class StepFailedError(Exception):
    """The step's own error type: it must reach the user unchanged."""


class TracedEachCall:
    """A step function the workers trace on every call, so its Python runs each time
    and counts the calls (a hashable function is traced once per argument
    signature): unhashable, and a new one each time (the workers keep functions by
    content)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self.calls = 0
        self.serial = next(_SERIALS)

    def __eq__(self, other: object) -> bool:
        return self is other


class FailsOnItsTrace(TracedEachCall):
    """``state + 1``, raising on its ``fail_at``-th call."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def __call__(self, state: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise StepFailedError(f"failed on call {self.calls}")
        return state + 1.0


class GrowsEachCall(TracedEachCall):
    """Returns one more output each call: outputs no earlier call predicts."""

    def __call__(self, x: Any) -> Any:
        self.calls += 1
        return tuple(x * i for i in range(self.calls))


def _zeros(strategy: RemoteStrategy) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros((), np.float32))


def _double(x: Any) -> Any:
    return x * 2.0


def test_a_failing_run_among_50_raises_at_the_next_reduce(strategy: RemoteStrategy) -> None:
    step = FailsOnItsTrace(fail_at=25)
    state = _zeros(strategy)
    for _ in range(50):
        state = strategy.run(step, args=(state,))  # the 25th fails
    with pytest.raises(StepFailedError, match="failed on call 25") as info:
        strategy.reduce("SUM", state, axis=None)
    notes = "\n".join(info.value.__notes__)
    assert "jaxpod: raised by strategy.run(FailsOnItsTrace)" in notes
    assert f"issued asynchronously at {__file__}:{_line_of('# the 25th fails')}" in notes
    assert "25 later operations that used its results were not run" in notes
    assert re.search(r"surfaced at reduce \(.*test_async_dispatch\.py:\d+", notes)
    assert "Remote traceback" in notes  # the workers' traceback comes along

    # The strategy goes on: a fresh state gives the right answer.
    x = np.arange(REPLICAS * 3, dtype=np.float32).reshape(REPLICAS, 3)
    batches = iter(strategy.experimental_distribute_dataset([x]))
    out = strategy.run(_double, args=(next(batches),))
    for _ in range(10):  # async now: a template exists for this signature
        out = strategy.run(_double, args=(out,))
    np.testing.assert_allclose(strategy.gather(out, axis=0), x * 2.0 ** 11)


def test_the_handles_of_a_failed_call_are_refused_once_it_raised(
        strategy: RemoteStrategy) -> None:
    step = FailsOnItsTrace(fail_at=2)
    first = strategy.run(step, args=(_zeros(strategy),))  # waits: the first call
    lost = strategy.run(step, args=(first,))  # asynchronous; fails
    with pytest.raises(StepFailedError):
        strategy.reduce("SUM", lost, axis=None)
    with pytest.raises(jaxpod.HandleError, match=r"strategy.run\(FailsOnItsTrace\)"):
        strategy.run(_double, args=(lost,))
    np.testing.assert_allclose(strategy.reduce("SUM", first, axis=None), REPLICAS * 1.0)


def test_outputs_that_differ_from_the_prediction_fail_the_call(
        strategy: RemoteStrategy) -> None:
    grows = GrowsEachCall()
    x = np.ones(2, np.float32)
    assert len(strategy.run(grows, args=(x,))) == 1  # waits; becomes the template
    predicted = strategy.run(grows, args=(x,))  # predicted 1 output; makes 2
    assert len(predicted) == 1
    with pytest.raises(jaxpod.AsyncPredictionError, match="JAXPOD_ASYNC_DISPATCH=0"):
        strategy.reduce("SUM", predicted[0], axis=None)
    # The template was dropped: the next call waits and gets its real outputs.
    third = strategy.run(grows, args=(x,))
    assert len(third) == 3
    np.testing.assert_allclose(strategy.reduce("SUM", third[2], axis=None),
                               x * 2 * REPLICAS)


def test_calls_behind_a_wrong_prediction_are_not_run_and_keep_nothing(
        strategy: RemoteStrategy) -> None:
    """A call whose outputs differ from the prediction, and one using its output
    (both asynchronous; the service may send the second before the first answers):
    the first raises, the second is counted as not run, and nothing either made
    stays on the hosts."""
    grows = GrowsEachCall()
    x = np.ones(2, np.float32)
    (kept,) = strategy.run(grows, args=(x,))  # waits; the template
    strategy.run(_double, args=(kept,))  # waits; _double's template for this shape
    predicted = strategy.run(grows, args=(x,))  # predicted 1 output; makes 2
    after = strategy.run(_double, args=(predicted[0],))
    with pytest.raises(jaxpod.AsyncPredictionError) as info:
        strategy.reduce("SUM", after, axis=None)
    notes = "\n".join(info.value.__notes__)
    assert "1 later operation that used its results were not run" in notes, notes
    del predicted, after
    gc.collect()
    assert [s["num_values"] for s in strategy.stats()] == [1, 1]  # `kept` alone
    # grows' first call returned (x * 0,): doubled and summed over replicas, still 0.
    np.testing.assert_array_equal(
        strategy.reduce("SUM", strategy.run(_double, args=(kept,)), axis=None), x * 0)


def test_synchronous_dispatch_raises_at_the_call(client: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_ASYNC_DISPATCH", "0")
    with client.strategy("v4-16", timeout_s=120) as strategy:
        step = FailsOnItsTrace(fail_at=3)
        state = _zeros(strategy)
        state = strategy.run(step, args=(state,))
        state = strategy.run(step, args=(state,))
        with pytest.raises(StepFailedError, match="failed on call 3"):
            strategy.run(step, args=(state,))
        np.testing.assert_allclose(strategy.reduce("SUM", state, axis=None), REPLICAS * 2.0)


def test_a_small_window_bounds_what_is_in_flight(client: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXPOD_ASYNC_WINDOW", "3")
    with client.strategy("v4-16", timeout_s=120) as strategy:
        state = _zeros(strategy)
        for _ in range(100):
            state = strategy.run(_plus_one, args=(state,))
            assert len(strategy._ops._pending) <= 3
        np.testing.assert_allclose(strategy.reduce("SUM", state, axis=None),
                                   REPLICAS * 100.0)


def test_calls_are_checked_on_the_client_at_once(strategy: RemoteStrategy,
                                                 client: Any) -> None:
    with pytest.raises(TypeError, match="str"):
        strategy.run(_double, args=("not an array",))
    with client.strategy("v4-8", timeout_s=120) as other:
        foreign = other.run(_double, args=(np.ones(2, np.float32),))
        with pytest.raises(jaxpod.HandleError, match="cannot move between strategies"):
            strategy.run(_double, args=(foreign,))
    strategy.close()
    with pytest.raises(jaxpod.SessionError, match="strategy is closed"):
        strategy.run(_double, args=(np.ones(2, np.float32),))


def test_close_raises_a_failure_not_raised_yet(client: Any) -> None:
    strategy = client.strategy("v4-16", timeout_s=120)
    step = FailsOnItsTrace(fail_at=2)
    state = strategy.run(step, args=(_zeros(strategy),))
    strategy.run(step, args=(state,))  # fails; nothing synchronises before close
    with pytest.raises(StepFailedError):
        strategy.close()
    assert strategy.closed
    # The slice was released anyway: it can be acquired again.
    with client.strategy("v4-16", timeout_s=120) as again:
        np.testing.assert_allclose(again.reduce("SUM", _zeros(again), axis=None), 0.0)


def test_next_runs_ahead_and_raises_end_of_data_at_the_next_past_it(
        strategy: RemoteStrategy) -> None:
    rng = np.random.default_rng(0)
    # 12 full batches of 16 rows (2 per replica), then one of 5: a partial last step.
    batches = [rng.normal(size=(16, 3)).astype(np.float32) for _ in range(12)]
    batches.append(rng.normal(size=(5, 3)).astype(np.float32))
    it = iter(strategy.experimental_distribute_dataset(batches))
    seen = []
    for _ in batches:
        seen.append(strategy.run(_double, args=(next(it),)))
    # The workers reported full steps ahead, so some nexts did not wait.
    assert it._full_until > 2
    with pytest.raises(jaxpod.EndOfDataError):
        next(it)
    for batch, out in zip(batches, seen, strict=True):
        np.testing.assert_allclose(strategy.gather(out, axis=0), batch * 2.0)


def _plus_one(x: Any) -> Any:
    return x + 1.0


def _line_of(marker: str) -> int:
    """The number of this file's line that ends with ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    found = [n for n, text in enumerate(lines, 1) if text.endswith(marker)]
    assert len(found) == 1, found
    return found[0]
