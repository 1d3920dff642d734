"""Named counts (depths, windows): defaults, environment overrides, clear refusals."""

from __future__ import annotations

import pytest

from jaxpod.timeouts import Count

DEPTH = Count("JAXPOD_TEST_DEPTH", 8, "things in flight")


def test_a_count_comes_from_its_default_the_environment_or_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEPTH.env_var, raising=False)
    assert DEPTH.value() == 8
    monkeypatch.setenv(DEPTH.env_var, " 3 ")
    assert DEPTH.value() == 3
    assert DEPTH.value(5) == 5  # the call's own beats the environment


@pytest.mark.parametrize("bad", ["0", "-2", "many", "1.5"])
def test_a_count_that_is_not_a_positive_int_is_refused_naming_its_variable(
        monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(DEPTH.env_var, bad)
    with pytest.raises(ValueError, match=(
            rf"JAXPOD_TEST_DEPTH \(things in flight\) must be a positive int\. Got "
            rf"'{bad}'\. Fix: set it to e\.g\. JAXPOD_TEST_DEPTH=8 or unset it\.")):
        DEPTH.value()
    with pytest.raises(ValueError, match="Got 0"):
        DEPTH.value(0)
