"""The straggler rule (:mod:`jaxpod.service.jobs.stragglers`) on hand-made host reports:
which host is flagged, after how many reports, and when it is let go. The figures each
host reports are running totals, as the hosts keep them."""

from __future__ import annotations

import numpy as np

from jaxpod.service.jobs.stragglers import (
    STRAGGLER_RATIO,
    STRAGGLER_REPORTS,
    HostCounters,
    Stragglers,
    medians_of_others,
)


def _reports(step_s: np.ndarray, input_s: np.ndarray, steps: int = 4) -> list[list[HostCounters]]:
    """Running totals after each of ``len(step_s)`` windows of ``steps`` steps, host ``h``
    taking ``step_s[w, h]`` seconds per step and waiting ``input_s[w, h]`` of it."""
    loop = np.cumsum(step_s * steps, axis=0)
    waited = np.cumsum(input_s * steps, axis=0)
    return [[HostCounters(steps * (w + 1), float(loop[w, h]), float(waited[w, h]))
             for h in range(step_s.shape[1])] for w in range(step_s.shape[0])]


def _flags(reports: list[list[HostCounters]]) -> tuple[Stragglers, list[list[int]]]:
    tracker = Stragglers()
    return tracker, [tracker.update(r) for r in reports]


def test_a_host_whose_loops_are_slow_is_flagged_after_several_reports() -> None:
    windows, hosts = 6, 4
    step_s = np.full((windows, hosts), 0.1)
    step_s[:, 2] = 0.1 * (STRAGGLER_RATIO + 1)
    tracker, new = _flags(_reports(step_s, np.zeros_like(step_s)))
    # The first report is a baseline; each later one is a window.
    flagged_at = [i for i, hosts_new in enumerate(new) if hosts_new]
    assert flagged_at == [STRAGGLER_REPORTS] and new[STRAGGLER_REPORTS] == [2]
    assert set(tracker.flagged) == {2} and "per step" in tracker.flagged[2]
    np.testing.assert_allclose([p.step_s for p in tracker.paces], step_s[-1])


def test_a_host_within_the_ratio_is_not_flagged() -> None:
    step_s = np.full((8, 2), 0.1)
    step_s[:, 1] = 0.1 * STRAGGLER_RATIO * 0.9
    tracker, new = _flags(_reports(step_s, np.zeros_like(step_s)))
    assert not any(new) and tracker.flagged == {}


def test_in_lockstep_the_host_whose_input_holds_every_step_is_flagged() -> None:
    # Every host's loop takes the slowest one's time; host 0 waited for its input.
    step_s = np.full((5, 2), 0.2)
    input_s = np.zeros((5, 2))
    input_s[:, 0] = 0.15
    tracker, new = _flags(_reports(step_s, input_s))
    assert new[STRAGGLER_REPORTS] == [0] and set(tracker.flagged) == {0}
    assert "input" in tracker.flagged[0]
    # A small input wait, however many times the others', is no straggler.
    input_s[:, 0] = 0.01
    tracker, new = _flags(_reports(step_s, input_s))
    assert not any(new)


def test_a_straggler_that_recovers_is_let_go_and_a_restart_starts_over() -> None:
    step_s = np.full((7, 3), 0.1)
    step_s[: STRAGGLER_REPORTS + 1, 1] = 1.0
    tracker, new = _flags(_reports(step_s, np.zeros_like(step_s)))
    assert new[STRAGGLER_REPORTS] == [1] and tracker.flagged == {}
    # Totals that go down are a restarted slice: no window is made of them.
    again = Stragglers()
    first = _reports(np.full((2, 2), 0.1), np.zeros((2, 2)))
    assert again.update(first[1]) == [] and again.update(first[0]) == []
    assert again.paces == ()


def test_a_single_host_is_never_a_straggler() -> None:
    step_s = np.full((6, 1), 5.0)
    tracker, new = _flags(_reports(step_s, np.zeros_like(step_s)))
    assert not any(new) and tracker.flagged == {}


def test_each_hosts_median_of_the_others_equals_numpys() -> None:
    rng = np.random.default_rng(3)
    for n in (2, 3, 4, 7, 256):
        values = rng.exponential(size=n).round(2)  # ties included
        got = medians_of_others(list(values))
        expected = [float(np.median(np.delete(values, i))) for i in range(n)]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert medians_of_others([1.0]) == [None]
