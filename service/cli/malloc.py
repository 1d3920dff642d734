"""glibc malloc settings for the jaxpod service, which moves large buffers through
short-lived objects.

Left to its defaults, glibc gives each thread its own arena (up to eight per core) in
heaps of at most 64 MiB that it unmaps as they empty, and hands freed memory at a heap's
top back to the kernel once 128 KiB (or, as it adapts, twice the largest block freed)
sits there. The service receives a gathered array from a host worker into a new 4 MiB
``bytes`` object per piece, forwards it and frees it a moment later: with the defaults
almost every page of every piece was fresh memory, faulted in and zeroed by the kernel
(about 30,000 page faults per 256 MiB gather, a fifth of the service's CPU time).
With few arenas and fixed thresholds, freed pieces are reused instead.

Turn it off with ``JAXPOD_TUNE_MALLOC=0``. A C library other than glibc is left alone.
"""

from __future__ import annotations

import ctypes

from jaxpod import settings

#: Set to ``0`` to keep the C library's own malloc settings.
TUNE_ENV = settings.TUNE_MALLOC.name
#: Arenas for all threads together (glibc's default is eight per core).
ARENA_MAX = 2
#: Blocks smaller than this come from a heap (and are reused), not from their own mmap.
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for it on 64-bit machines
#: Freed memory at a heap's top that stays with the process before going back.
TRIM_THRESHOLD_BYTES = 256 << 20

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_malloc() -> bool:
    """Applies the settings above to this process. Call it before the process starts
    threads: arenas that exist already stay.

    Returns:
      Whether the C library took all of them (``False`` where it is not glibc, or
      where ``JAXPOD_TUNE_MALLOC=0``).
    """
    if not settings.TUNE_MALLOC.get():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (AttributeError, OSError):
        return False
    wanted = ((_M_ARENA_MAX, ARENA_MAX), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
              (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return all([mallopt(param, value) == 1 for param, value in wanted])
