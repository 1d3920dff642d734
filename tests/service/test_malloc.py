"""The service's malloc settings: taken on glibc, left alone when turned off, a clear
error for a bad switch. Each case runs in a fresh interpreter (arenas are per process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from jaxpod.service.malloc import TUNE_ENV


def _tune(switch: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != TUNE_ENV}
    if switch is not None:
        env[TUNE_ENV] = switch
    return subprocess.run(
        [sys.executable, "-c",
         "from jaxpod.service.malloc import tune_malloc; print(tune_malloc())"],
        env=env, capture_output=True, text=True, timeout=120, check=False)


def test_settings_are_taken_on_glibc_by_default() -> None:
    done = _tune(None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(platform.libc_ver()[0] == "glibc")


def test_switched_off_it_leaves_the_allocator_alone() -> None:
    done = _tune("0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_bad_switch_says_what_it_takes() -> None:
    done = _tune("yes")
    assert done.returncode != 0
    assert f"{TUNE_ENV} must be 0" in done.stderr and "Got 'yes'" in done.stderr
