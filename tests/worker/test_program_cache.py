"""The bounded program cache the engine, global-view jobs and checkpoints share."""

from __future__ import annotations

import pytest

from jaxpod.worker.program_cache import ProgramCache


def test_the_least_recently_used_program_is_dropped_past_the_size() -> None:
    built: list[str] = []

    def build(key: str) -> str:
        built.append(key)
        return f"program {key}"

    cache = ProgramCache(2)
    assert cache.get("a", lambda: build("a")) == "program a"
    assert cache.get("b", lambda: build("b")) == "program b"
    assert cache.get("a", lambda: build("a")) == "program a"  # used: b is now the oldest
    assert cache.get("c", lambda: build("c")) == "program c"
    assert "b" not in cache and "a" in cache and len(cache) == 2
    assert cache.get("b", lambda: build("b")) == "program b"  # built again
    assert built == ["a", "b", "c", "b"]


def test_an_unhashable_key_is_built_each_time_and_not_kept() -> None:
    cache = ProgramCache(4)
    built = []
    for _ in range(2):
        cache.get(("run", [1, 2]), lambda: built.append(1))  # type: ignore[arg-type]
    assert len(built) == 2 and len(cache) == 0


def test_a_cache_must_hold_a_program() -> None:
    with pytest.raises(ValueError, match="at least 1 program; got 0"):
        ProgramCache(0)
