"""A host's ``jax.profiler`` traces: one capture at a time, ended by its own timer.

The coordinator asks every host of a slice to start a trace in the same operation,
into ``<folder>/host-<i>``; each host ends it after the capture's seconds on its own
clock (a trace's length does not depend on when the next operation arrives), and
:meth:`HostProfiler.stop` ends it early if it is still running and lists what the
profiler wrote there. The layout is TensorBoard's (``plugins/profile/<run>/<host>
.xplane.pb``): xprof, TensorBoard's profile plugin and ``jax.profiler.ProfileData``
read it; ``gs://`` folders work as orbax's do.
"""

from __future__ import annotations

import logging
import threading

import jax

logger = logging.getLogger(__name__)

#: The trace files a capture leaves, relative to its folder.
TRACE_GLOB = "plugins/profile/*/*.xplane.pb"


class ProfileBusyError(RuntimeError):
    """A capture was asked for while this host's previous one still runs."""


class HostProfiler:
    """This host's one ``jax.profiler`` capture at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folder: str | None = None  # the capture's, until stop() lists its files
        self._tracing = False
        self._timer: threading.Timer | None = None

    def start(self, folder: str, seconds: float) -> None:
        """Starts tracing into ``folder``; the trace ends after ``seconds``."""
        with self._lock:
            if self._folder is not None:
                raise ProfileBusyError(
                    f"This host is still capturing a profile into {self._folder}; one "
                    "capture runs at a time. Wait for it to end and ask again.")
            jax.profiler.start_trace(folder)
            self._folder, self._tracing = folder, True
            self._timer = threading.Timer(seconds, self._end_trace)
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> list[str]:
        """Ends the capture if it still runs; the trace files it wrote (none if no
        capture was started)."""
        from etils import epath

        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            folder, self._folder = self._folder, None
        self._end_trace()
        if folder is None:
            return []
        return sorted(str(p) for p in epath.Path(folder).glob(TRACE_GLOB))

    def discard(self) -> None:
        """Ends any capture (the slice is reset: its holder is gone)."""
        try:
            self.stop()
        except Exception:  # the trace's folder may be unreachable: nothing to keep
            logger.warning("ending a profile capture failed", exc_info=True)

    def _end_trace(self) -> None:
        with self._lock:
            if not self._tracing:
                return
            self._tracing = False
            jax.profiler.stop_trace()
