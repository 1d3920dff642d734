"""Goodput accounting: the clock that partitions a job's wall time into categories, and
its totals in the job store. A fake clock stands in for time; the store is a real
SQLite file under tmp_path."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from jaxpod.errors import JobNotFoundError
from jaxpod.service.jobs import goodput as gp
from jaxpod.service.jobs.goodput import (
    ALLOCATING,
    CATEGORIES,
    CHECKPOINTING,
    COMPILING,
    LOST_WORK,
    OTHER,
    PRODUCTIVE,
    QUEUED,
    RECOVERING,
    SETUP,
    GoodputClock,
    summary,
)
from jaxpod.service.jobs.store import JobStore, JobStoreError


class FakeClock:
    """Time that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _fsum(totals: dict[str, float]) -> float:
    return math.fsum(totals.values())


def test_categories_are_the_documented_ones() -> None:
    assert CATEGORIES == ("queued", "allocating", "setup", "restoring", "compiling", "productive",
                          "input_wait", "metrics", "monitoring", "checkpointing", "result",
                          "lost_work", "resizing", "recovering", "suspended", "other")
    assert set(GoodputClock(clock=FakeClock()).totals()) == set(CATEGORIES)


def test_the_categories_partition_the_wall_time_exactly() -> None:
    clock = FakeClock(12345.678)
    start = clock.now
    goodput = GoodputClock(clock=clock)
    assert goodput.category == QUEUED
    # Awkward decimal durations: float sums of them drift, integer nanoseconds do not.
    for category, seconds in [(ALLOCATING, 0.1), (SETUP, 0.7), (PRODUCTIVE, 2.3),
                              (CHECKPOINTING, 0.01), (PRODUCTIVE, 1.1), (OTHER, 0.003),
                              (PRODUCTIVE, 0.2), (QUEUED, 0.0)] * 50:
        clock.advance(seconds)
        goodput.switch(category)
    clock.advance(0.4)  # the running interval (in QUEUED) counts too
    totals = goodput.totals()
    wall_ns = round(clock.now * 1e9) - round(start * 1e9)
    assert sum(round(s * 1e9) for s in totals.values()) == wall_ns
    assert goodput.wall_s() == wall_ns / 1e9
    assert _fsum(totals) == pytest.approx(clock.now - start, abs=1e-9)
    assert totals[QUEUED] == pytest.approx(0.1 * 50 + 0.4)  # each QUEUED stint, then 0.4
    assert totals[ALLOCATING] == pytest.approx(0.7 * 50)
    assert totals[SETUP] == pytest.approx(2.3 * 50)
    assert totals[PRODUCTIVE] == pytest.approx((0.01 + 0.003 + 0.0) * 50)


def test_switch_returns_the_previous_category_and_refuses_unknown_ones() -> None:
    clock = FakeClock()
    goodput = GoodputClock(ALLOCATING, clock=clock)
    clock.advance(2.0)
    assert goodput.switch(SETUP) == ALLOCATING
    assert goodput.switch(SETUP) == SETUP  # the same category: nothing changes
    with pytest.raises(ValueError, match="Unknown goodput category 'waiting'; expected one "
                                         "of queued, allocating"):
        goodput.switch("waiting")
    with pytest.raises(ValueError, match="Unknown goodput category"):
        GoodputClock("busy", clock=clock)
    assert goodput.category == SETUP
    assert goodput.totals()[ALLOCATING] == 2.0


def test_totals_include_the_running_interval_up_to_now() -> None:
    clock = FakeClock(0.0)
    goodput = GoodputClock(PRODUCTIVE, clock=clock)
    clock.advance(5.0)
    assert goodput.totals(now=2.0)[PRODUCTIVE] == 2.0
    assert goodput.totals()[PRODUCTIVE] == 5.0
    assert goodput.totals(now=-1.0)[PRODUCTIVE] == 0.0  # a stale reading adds nothing
    clock.advance(1.0)
    assert goodput.wall_s() == 6.0 and goodput.wall_s(now=3.0) == 3.0


def test_during_counts_a_block_and_goes_back_also_on_error() -> None:
    clock = FakeClock()
    goodput = GoodputClock(PRODUCTIVE, clock=clock)
    clock.advance(1.0)
    with goodput.during(CHECKPOINTING):
        assert goodput.category == CHECKPOINTING
        clock.advance(0.5)
    assert goodput.category == PRODUCTIVE
    with pytest.raises(RuntimeError), goodput.during(OTHER):
        clock.advance(0.25)
        raise RuntimeError("boom")
    assert goodput.category == PRODUCTIVE
    clock.advance(1.0)
    assert {k: v for k, v in goodput.totals().items() if v} == {
        PRODUCTIVE: 2.0, CHECKPOINTING: 0.5, OTHER: 0.25}


def test_a_stopped_clock_keeps_its_final_totals() -> None:
    clock = FakeClock()
    goodput = GoodputClock(PRODUCTIVE, clock=clock)
    clock.advance(3.0)
    final = goodput.stop()
    assert goodput.stopped and final[PRODUCTIVE] == 3.0
    clock.advance(10.0)
    assert goodput.totals() == final and goodput.wall_s() == 3.0
    assert goodput.stop() == final  # again: a no-op
    # The runner may still re-attribute the last loop's time after the end.
    assert goodput.reattribute({COMPILING: 1.0}) == {COMPILING: 1.0}
    assert goodput.wall_s() == 3.0
    with pytest.raises(RuntimeError, match="stopped"):
        goodput.switch(OTHER)
    with pytest.raises(RuntimeError, match="stopped"), goodput.during(OTHER):
        pass


def test_reattribute_moves_part_of_a_measured_loop_keeping_the_sum() -> None:
    clock = FakeClock()
    goodput = GoodputClock(SETUP, clock=clock)
    clock.advance(1.0)
    goodput.switch(PRODUCTIVE)
    clock.advance(10.0)  # a loop of 10 steps, still running in PRODUCTIVE
    # It compiled (3 s beyond its steady 7 s) and 2 of its 10 steps re-did lost work.
    moved = goodput.reattribute({COMPILING: 3.0, LOST_WORK: 7.0 * 2 / 10})
    assert moved == {COMPILING: 3.0, LOST_WORK: 1.4}
    totals = goodput.totals()
    assert (totals[SETUP], totals[COMPILING], totals[LOST_WORK]) == (1.0, 3.0, 1.4)
    assert totals[PRODUCTIVE] == pytest.approx(5.6)
    assert _fsum(totals) == pytest.approx(11.0, abs=1e-9)
    assert goodput.category == PRODUCTIVE
    clock.advance(1.0)  # the next interval starts after the re-attributed one
    assert goodput.totals()[PRODUCTIVE] == pytest.approx(6.6)


def test_reattribute_from_another_category_and_never_below_zero() -> None:
    clock = FakeClock()
    goodput = GoodputClock(SETUP, clock=clock)
    clock.advance(2.0)
    goodput.switch(OTHER)
    clock.advance(1.0)
    # Asked for 6 s out of SETUP's 2 s: both parts shrink alike, SETUP ends at 0.
    moved = goodput.reattribute({COMPILING: 3.0, LOST_WORK: 1.0, SETUP: 5.0}, source=SETUP)
    assert moved == {COMPILING: 1.5, LOST_WORK: 0.5, SETUP: 0.0}
    totals = goodput.totals()
    assert (totals[SETUP], totals[COMPILING], totals[LOST_WORK], totals[OTHER]) == (
        0.0, 1.5, 0.5, 1.0)
    assert goodput.reattribute({COMPILING: 1.0}, source=SETUP) == {COMPILING: 0.0}
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite and >= 0"):
            goodput.reattribute({COMPILING: bad})
    with pytest.raises(ValueError, match="Unknown goodput category"):
        goodput.reattribute({"jit": 1.0})
    assert _fsum(goodput.totals()) == pytest.approx(3.0, abs=1e-9)


def test_a_clock_rebuilt_from_totals_goes_on_and_gives_the_downtime_to_recovering() -> None:
    clock = FakeClock()
    before = GoodputClock(clock=clock)
    clock.advance(4.0)
    before.switch(PRODUCTIVE)
    clock.advance(6.0)
    stored = summary(before.totals())  # what a status carried; the extra keys are ignored
    # The coordinator stored 10 s of totals, died, and comes back 15 s after the job began.
    clock.advance(5.0)
    after = GoodputClock.from_totals(stored, wall_s=15.0, clock=clock)
    assert after.category == RECOVERING
    clock.advance(2.0)
    after.switch(QUEUED)
    clock.advance(1.0)
    totals = after.totals()
    assert (totals[QUEUED], totals[PRODUCTIVE], totals[RECOVERING]) == (5.0, 6.0, 7.0)
    assert _fsum(totals) == 18.0  # the job's wall time: 15 s then 3 s more
    # Without wall_s (or with less than the totals) nothing is added; the category is free.
    again = GoodputClock.from_totals(stored, wall_s=1.0, category=ALLOCATING, clock=clock)
    assert again.category == ALLOCATING and again.totals()[RECOVERING] == 0.0
    assert _fsum(GoodputClock.from_totals(stored, clock=clock).totals()) == 10.0
    with pytest.raises(ValueError, match="Unknown goodput category 'jit'"):
        GoodputClock.from_totals({"jit": 1.0}, clock=clock)
    with pytest.raises(ValueError, match="finite and >= 0"):
        GoodputClock.from_totals({QUEUED: -1.0}, clock=clock)


def test_summary_adds_the_wall_time_and_the_productive_share() -> None:
    result = summary({QUEUED: 1.0, PRODUCTIVE: 3.0, OTHER: 0.0})
    assert result == {QUEUED: 1.0, PRODUCTIVE: 3.0, OTHER: 0.0, gp.WALL_S: 4.0,
                      gp.PRODUCTIVE_SHARE: 0.75}
    assert summary(result) == result  # idempotent: its own keys are not categories
    assert summary({})[gp.PRODUCTIVE_SHARE] == 0.0
    assert summary({QUEUED: 0.0}) == {QUEUED: 0.0, gp.WALL_S: 0.0, gp.PRODUCTIVE_SHARE: 0.0}


def test_the_clock_is_thread_safe() -> None:
    ticks = iter(range(1, 10**9))
    lock = threading.Lock()

    def clock() -> float:  # every reading one millisecond later, whoever reads
        with lock:
            return next(ticks) / 1000

    goodput = GoodputClock(clock=clock)
    targets = [PRODUCTIVE, CHECKPOINTING, OTHER, LOST_WORK]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for n in range(500):
                goodput.switch(targets[(i + n) % len(targets)])
                if n % 7 == 0:
                    goodput.reattribute({COMPILING: 0.0005})
                if n % 11 == 0:
                    with goodput.during(SETUP):
                        pass
                goodput.totals()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    end = clock()
    totals = goodput.totals(now=end)
    assert min(totals.values()) >= 0
    # Started at the first reading (1 ms); every reading since partitions into categories.
    assert sum(round(s * 1e9) for s in totals.values()) == round(end * 1e9) - 1_000_000


# --------------------------------------------------------------------------- the store

def test_the_store_keeps_a_jobs_goodput_and_replaces_it(tmp_path: Path) -> None:
    clock = FakeClock()
    goodput = GoodputClock(clock=clock)
    clock.advance(1.5)
    goodput.switch(PRODUCTIVE)
    clock.advance(2.25)
    with JobStore(tmp_path) as store:
        store.create_job(steps=3, payload=b"", job_id="j")
        store.create_job(steps=3, payload=b"", job_id="k")
        assert store.goodput("j") == {}
        store.set_goodput("j", goodput.totals())
        store.set_goodput("k", {QUEUED: 9.0})
        assert store.goodput("j") == goodput.totals()
        store.set_goodput("j", {QUEUED: 1.5, PRODUCTIVE: 3.0})  # replaces every row
        assert store.goodput("j") == {QUEUED: 1.5, PRODUCTIVE: 3.0}
        for bad, match in [({QUEUED: -1.0}, "finite and >= 0"),
                           ({QUEUED: math.nan}, "finite and >= 0"),
                           ({QUEUED: 1.0, PRODUCTIVE: "x"}, "finite and >= 0"),
                           ({gp.WALL_S: 4.5}, "not the summary's wall_s"),
                           ({"": 1.0}, "category name")]:
            with pytest.raises(JobStoreError, match=match):
                store.set_goodput("j", bad)  # type: ignore[arg-type]
        assert store.goodput("j") == {QUEUED: 1.5, PRODUCTIVE: 3.0}  # nothing written
        with pytest.raises(JobNotFoundError):
            store.set_goodput("nope", {QUEUED: 1.0})
        with pytest.raises(JobNotFoundError):
            store.goodput("nope")
    with JobStore(tmp_path) as reopened:  # a restarted coordinator reads them back
        assert reopened.goodput("j") == {QUEUED: 1.5, PRODUCTIVE: 3.0}
        assert reopened.goodput("k") == {QUEUED: 9.0}
        clock.advance(100.0)
        resumed = GoodputClock.from_totals(reopened.goodput("j"), wall_s=6.0, clock=clock)
        assert resumed.totals()[RECOVERING] == 1.5
