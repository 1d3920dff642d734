"""The service's malloc settings: taken on glibc (in a fresh interpreter: arenas are per
process), left alone when turned off, a clear error for a bad switch."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from jaxpod.service.cli.malloc import TUNE_ENV, tune_malloc


def _tune() -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TUNE_ENV}
    return subprocess.run(
        [sys.executable, "-c",
         "from jaxpod.service.cli.malloc import tune_malloc; print(tune_malloc())"],
        env=env, capture_output=True, text=True, timeout=120, check=False)


def test_settings_are_taken_on_glibc_by_default() -> None:
    done = _tune()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(platform.libc_ver()[0] == "glibc")


def test_switched_off_it_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TUNE_ENV, "0")
    assert tune_malloc() is False  # returns before touching the allocator


def test_a_bad_switch_says_what_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TUNE_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{TUNE_ENV}='maybe' is not valid: expected 0 or 1"):
        tune_malloc()
