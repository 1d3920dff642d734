"""The fair-share scheduler as the pure function it is: shares, borrowing, reclaiming,
victim choice, guarantees, the decayed usage (against numpy's integration)."""

from __future__ import annotations

import numpy as np

from jaxpod.service.jobs.fair_share import (
    Snapshot,
    Started,
    Team,
    Usage,
    Waiting,
    plan,
    why_waiting,
)

HOUR = 3600.0


def waiting(job_id: str, team: str = "default", kind: str = "v4-8", priority: int = 0,
            order: int = 0, slices: int = 1) -> Waiting:
    return Waiting(job_id, team, (kind,), slices, priority, (-priority, order))


def started(job_id: str, team: str = "default", kind: str = "v4-8", priority: int = 0,
            at: float = 0.0, min_runtime_s: float = 0.0) -> Started:
    return Started(job_id, team, kind, 1, priority, at, min_runtime_s)


TWO_TEAMS = {"a": Team("a", 2.0), "b": Team("b", 1.0)}


def test_usage_decays_as_the_integral_of_held_slices_does() -> None:
    half_life = 2 * HOUR
    usage = Usage(0.0, {"a": 5000.0})
    held = [(HOUR, {"a": 3, "b": 1}), (4 * HOUR, {"b": 2})]  # (until, slices)
    for end, slices in held:
        usage = usage.advance(end, slices, half_life)
    # numpy: every slice-second held, weighted by 2^(-age / half-life) at the end
    t = np.linspace(0.0, 4 * HOUR, 400_001)
    dt = t[1] - t[0]
    weight = 0.5 ** ((4 * HOUR - t) / half_life)
    a = np.where(t < HOUR, 3, 0)
    b = np.where(t < HOUR, 1, 2)
    want_a = 5000.0 * 0.5 ** (4 * HOUR / half_life) + np.trapezoid(a * weight, dx=dt)
    want_b = np.trapezoid(b * weight, dx=dt)
    assert abs(usage.slice_seconds["a"] - want_a) / want_a < 1e-3
    assert abs(usage.slice_seconds["b"] - want_b) / want_b < 1e-3


def test_without_teams_jobs_start_by_priority_then_in_order() -> None:
    snap = Snapshot(0.0, {}, Usage(0.0), [waiting("late", order=2),
                                          waiting("early", order=1),
                                          waiting("urgent", priority=5, order=3)],
                    [], {"v4-8": 1})
    decided = plan(snap)
    assert [s.job_id for s in decided.starts] == ["urgent"]
    assert decided.preemptions == ()


def test_one_start_per_type_and_pass_and_other_types_go_on() -> None:
    snap = Snapshot(0.0, {}, Usage(0.0), [waiting("x1", order=1), waiting("x2", order=2),
                                          waiting("y1", kind="v4-16", order=3)],
                    [], {"v4-8": 2, "v4-16": 1})
    assert [(s.job_id, s.accelerator_type) for s in plan(snap).starts] == [
        ("x1", "v4-8"), ("y1", "v4-16")]


def test_a_higher_priority_preempts_the_lowest_most_recent_and_equal_never() -> None:
    running = [started("old-low", priority=0, at=10.0), started("new-low", priority=0, at=20.0),
               started("mid", priority=3, at=30.0)]
    urgent = plan(Snapshot(100.0, {}, Usage(0.0), [waiting("urgent", priority=5)], running, {}))
    assert [p.victim for p in urgent.preemptions] == ["new-low"]
    equal = plan(Snapshot(100.0, {}, Usage(0.0), [waiting("peer", priority=3)],
                          [started("mid", priority=3)], {}))
    assert equal.preemptions == ()


def test_free_slices_go_to_the_team_furthest_below_its_share() -> None:
    usage = Usage(0.0, {"a": 4 * HOUR, "b": 1 * HOUR})  # a used 4 over weight 2: 2 > 1
    snap = Snapshot(0.0, TWO_TEAMS, usage, [waiting("a1", "a", order=1),
                                             waiting("b1", "b", order=2)],
                    [], {"v4-8": 1})
    assert [s.job_id for s in plan(snap).starts] == ["b1"]
    usage = Usage(0.0, {"a": 1 * HOUR, "b": 1 * HOUR})  # a: 0.5, b: 1
    snap = Snapshot(0.0, TWO_TEAMS, usage, snap.waiting, [], {"v4-8": 1})
    assert [s.job_id for s in plan(snap).starts] == ["a1"]


def test_borrowed_slices_are_reclaimed_until_the_weights_hold_and_no_further() -> None:
    """Team b (weight 1) borrowed all 3 slices while a (weight 2) was idle; a asks for
    3: it reclaims 2, the most recently started first, and leaves b its 1."""
    running = {f"b{i}": started(f"b{i}", "b", at=float(i)) for i in range(3)}
    queue = [waiting(f"a{i}", "a", order=i) for i in range(3)]
    yielding: dict[str, str] = {}
    for _ in range(5):  # passes, the decided preemptions becoming slices given up
        decided = plan(Snapshot(100.0, TWO_TEAMS, Usage(100.0), queue,
                                list(running.values()), {}, yielding=yielding))
        yielding.update({p.victim: p.for_job for p in decided.preemptions})
    assert sorted(yielding) == ["b1", "b2"]
    assert sorted(yielding.values()) == ["a0", "a1"]
    # once they gave up: a holds 2, b 1, and nothing moves
    a_runs = [started("a0", "a", at=200.0), started("a1", "a", at=200.0)]
    settled = plan(Snapshot(300.0, TWO_TEAMS, Usage(300.0), [queue[2]],
                            [*a_runs, running["b0"]], {}))
    assert settled.preemptions == ()


def test_the_victim_is_lowest_priority_then_furthest_over_share_then_newest() -> None:
    teams = {"a": Team("a", 1.0), "b": Team("b", 1.0), "c": Team("c", 1.0)}
    running = [started("b-old", "b", at=1.0), started("b-new", "b", at=5.0),
               started("b-more", "b", at=2.0),
               started("c-new", "c", at=9.0), started("c-old", "c", at=3.0)]
    decided = plan(Snapshot(100.0, teams, Usage(100.0), [waiting("a1", "a")], running, {}))
    assert [p.victim for p in decided.preemptions] == ["b-new"]  # b holds 3, c 2
    running.append(started("c-low", "c", priority=-1, at=0.5))
    decided = plan(Snapshot(100.0, teams, Usage(100.0), [waiting("a1", "a")], running, {}))
    assert [p.victim for p in decided.preemptions] == ["c-low"]


def test_a_job_within_its_min_runtime_is_spared_unless_nothing_else_frees() -> None:
    running = [started("b-new", "b", at=95.0, min_runtime_s=60.0),
               started("b-old", "b", at=10.0, min_runtime_s=60.0),
               started("b-mid", "b", at=30.0, min_runtime_s=60.0)]
    decided = plan(Snapshot(100.0, TWO_TEAMS, Usage(100.0), [waiting("a1", "a")],
                            running, {}))
    assert [p.victim for p in decided.preemptions] == ["b-mid"]
    young = [started("b-new", "b", at=95.0, min_runtime_s=60.0),
             started("b-new2", "b", at=90.0, min_runtime_s=60.0)]
    decided = plan(Snapshot(100.0, TWO_TEAMS, Usage(100.0), [waiting("a1", "a")],
                            young, {}))
    assert [p.victim for p in decided.preemptions] == ["b-new"]


def test_a_guarantee_reclaims_whatever_the_shares() -> None:
    teams = {"a": Team("a", 1.0, {"v4-16": 1}), "b": Team("b", 100.0)}
    running = [started("b1", "b", kind="v4-16"), started("a-other", "a", kind="v4-8"),
               started("a-other2", "a", kind="v4-8")]
    # by weight a (holding 2 of weight 1) may not take from b (1 of weight 100)
    decided = plan(Snapshot(100.0, teams, Usage(100.0), [waiting("a1", "a", kind="v4-16")],
                            running, {}))
    assert [p.victim for p in decided.preemptions] == ["b1"]
    no_guarantee = {"a": Team("a", 1.0), "b": Team("b", 100.0)}
    decided = plan(Snapshot(100.0, no_guarantee, Usage(100.0),
                            [waiting("a1", "a", kind="v4-16")], running, {}))
    assert decided.preemptions == ()


def test_why_waiting_names_the_team_over_its_share() -> None:
    running = [started("a0", "a"), started("a1", "a"), started("a2", "a")]
    snap = Snapshot(0.0, TWO_TEAMS, Usage(0.0), [waiting("a3", "a"), waiting("b0", "b")],
                    running, {})
    assert why_waiting(snap, "a3") == (
        "team a is at or over its share: it holds 3 of its 2 slice(s); no free v4-8 "
        "slice it may take")
    assert why_waiting(snap, "b0") == "no free v4-8 slice"
    assert why_waiting(snap, "gone") is None


def test_the_job_a_slice_was_freed_for_takes_it_and_causes_no_other_preemption() -> None:
    """b0 gave its slice up for a0 (and is queued again, first): the free slice is
    a0's though team a holds more now, and b1 is not preempted for a0 meanwhile."""
    running = [started("a-run", "a"), started("a-run2", "a"), started("b1", "b")]
    queue = [waiting("b0", "b", order=-5), waiting("a0", "a", order=1)]
    decided = plan(Snapshot(100.0, TWO_TEAMS, Usage(100.0), queue, running, {"v4-8": 1},
                            yielding={"b0": "a0"}))
    assert [s.job_id for s in decided.starts] == ["a0"] and decided.preemptions == ()
    nothing_free = plan(Snapshot(100.0, TWO_TEAMS, Usage(100.0), queue, running, {},
                                 yielding={"b0": "a0"}))
    assert nothing_free.starts == () and nothing_free.preemptions == ()
