"""JAX's persistent compilation cache on a host: where it is, and what it saved.

A restarted attempt, or a later job of the same code, loads its programs from the
cache instead of compiling them again (JAX keys an entry by the program, the devices
and the compiler's options). Only a group's first process writes entries (JAX's rule:
many hosts racing on one bucket would clash); every host reads them, so the folder must
be one every host of a slice reaches (``JAXPOD_COMPILATION_CACHE_DIR``).

Simulated hosts are the exception: on CPU the key also covers the process (its
compile options and its topology's fingerprint differ), so no entry of the first
process ever serves another, and every other simulated host compiled each program
again at every restart, unlike a TPU slice. There every process writes its own
entries (:func:`enable` with ``every_process_writes``): they never share a key, so
they never race.
:func:`programs` counts what this process loaded from the cache and what it compiled.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from jaxpod import settings

logger = logging.getLogger(__name__)

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


def enable(every_process_writes: bool = False) -> str | None:
    """Points JAX at the cache and starts counting; call before the process compiles
    anything. ``every_process_writes``: this process writes its entries even when it
    is not the group's first (simulated hosts, see above). Returns the folder
    (``None``: the cache is off)."""
    global _listening
    import jax

    folder = cache_dir()
    if folder is None:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      settings.COMPILATION_CACHE_MIN_COMPILE.seconds())
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if every_process_writes:
        _write_from_every_process()
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count)
            _listening = True
    return folder


def _write_from_every_process() -> None:
    """Lets a process other than the group's first write its cache entries, as JAX's
    own writer does for the first (same checks: no host callbacks, compiled for at
    least the minimum time). JAX has no setting for it; where its private writer is
    not the one this was written for, entries stay first-process-only."""
    from jax._src import compilation_cache, compiler, config, distributed

    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "jaxpod_every_process", False):
        return

    def write(cache_key: str, compile_time_secs: float, module_name: str,
              backend: object, executable: object, host_callbacks: object) -> None:
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            original(cache_key, compile_time_secs, module_name, backend, executable,
                     host_callbacks)
            return
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # as JAX's writer: a cache that cannot be written is no error
            logger.warning("could not write %s to the compilation cache: %s", module_name, e)

    write.jaxpod_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = write


def programs() -> tuple[int, int] | None:
    """Programs this process loaded from the cache and compiled (missing from it),
    since it started; ``None`` when the cache is off (JAX then counts nothing)."""
    with _lock:
        return (_counts[_LOADED], _counts[_ASKED] - _counts[_LOADED]) if _listening else None


def _count(event: str, **kwargs: object) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1
