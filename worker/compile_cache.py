"""JAX's persistent compilation cache on a host: where it is, and what it saved.

A restarted attempt, or a later job of the same code, loads its programs from the
cache instead of compiling them again (JAX keys an entry by the program, the devices
and the compiler's options). Only a group's first process writes entries (JAX's rule:
many hosts racing on one bucket would clash); every host reads them, so the folder must
be one every host of a slice reaches (``JAXPOD_COMPILATION_CACHE_DIR``).

:func:`programs` counts what this process loaded from the cache and what it compiled.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from jaxpod import settings

_LOADED = "/jax/compilation_cache/cache_hits"
# Every compile with the cache on asks it first; what it did not load, it compiled.
# (JAX's own "cache_misses" event counts entries written, which only the first
# process does, and never a program with host callbacks.)
_ASKED = "/jax/compilation_cache/compile_requests_use_cache"

# JAX's event listeners are process-wide; so is what they count.
_lock = threading.Lock()
_counts = {_LOADED: 0, _ASKED: 0}
_listening = False


def cache_dir() -> str | None:
    """The cache's folder (``None``: off): ``$JAXPOD_COMPILATION_CACHE_DIR``, else
    ``compilation-cache/`` in ``$JAXPOD_CHECKPOINT_DIR`` (every host reaches it), else
    this machine's ``~/.cache/jaxpod/compilation-cache``."""
    chosen = settings.COMPILATION_CACHE_DIR.get()
    if chosen is not None:
        return None if chosen.strip().lower() == "off" else chosen
    checkpoints = settings.CHECKPOINT_DIR.get()
    if checkpoints:
        return f"{checkpoints.rstrip('/')}/compilation-cache"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache_home) / "jaxpod" / "compilation-cache")


def enable() -> str | None:
    """Points JAX at the cache and starts counting; call before the process compiles
    anything. Returns the folder (``None``: the cache is off)."""
    global _listening
    import jax

    folder = cache_dir()
    if folder is None:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      settings.COMPILATION_CACHE_MIN_COMPILE.seconds())
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count)
            _listening = True
    return folder


def programs() -> tuple[int, int] | None:
    """Programs this process loaded from the cache and compiled (missing from it),
    since it started; ``None`` when the cache is off (JAX then counts nothing)."""
    with _lock:
        return (_counts[_LOADED], _counts[_ASKED] - _counts[_LOADED]) if _listening else None


def _count(event: str, **kwargs: object) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1
