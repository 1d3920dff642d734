"""Preemption notices: a host learns it is about to be taken away.

On Kubernetes (and on GCE when a maintenance event evicts the VM) a host worker's
process gets SIGTERM some seconds before it is killed. :func:`install_sigterm_handler`
turns that signal into a recorded :class:`~jaxpod.operations.Notice` (when it came,
and ``"SIGTERM"``) and keeps the process running for ``JAXPOD_PREEMPTION_GRACE_S``
(default 30 s), so the coordinator can ask for the notice
(:class:`~jaxpod.operations.PreemptionNotices`), checkpoint, and release the slice
cleanly. After the grace the process exits as it would have without the handler (the
handler that was there before gets the signal), so a worker is never immortal.

Other sources of notices record theirs through :func:`record_notice`: the hook for a
later watcher of the GCE metadata server (``instance/preempted``,
``instance/maintenance-event`` on real TPU VMs), which needs network access and is not
built here. The first notice of a process is the one kept.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from jaxpod import settings
from jaxpod.operations import Notice

logger = logging.getLogger(__name__)

#: How long a worker keeps running after SIGTERM before it exits as it would have.
PREEMPTION_GRACE = settings.PREEMPTION_GRACE
#: After the grace, how long the previous handler gets to end the process before it is
#: ended with ``os._exit`` (its main thread may never run Python signal handlers again).
EXIT_BACKSTOP_S = 10.0

SIGTERM_REASON = "SIGTERM"


class PreemptionFlag:
    """The process's preemption notice, set at most once, readable from any thread.

    The lock is reentrant: the SIGTERM handler runs on the main thread between two
    bytecodes, possibly while that same thread holds the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._notice: Notice | None = None

    def notice(self) -> Notice | None:
        """The first notice recorded, or ``None``."""
        with self._lock:
            return self._notice

    def record(self, reason: str, at: float | None = None) -> Notice:
        """Records a notice (``at``: wall-clock seconds, now when ``None``) unless one
        is already recorded; returns the one kept (the earliest is what counts)."""
        with self._lock:
            if self._notice is None:
                self._notice = Notice(time.time() if at is None else at, reason)
            return self._notice


#: This process's flag.
FLAG = PreemptionFlag()


def notice() -> Notice | None:
    """This process's preemption notice, or ``None``."""
    return FLAG.notice()


def record_notice(reason: str, at: float | None = None) -> Notice:
    """Records a preemption notice from a source other than SIGTERM (the hook for a
    GCE metadata watcher: ``instance/preempted``, ``instance/maintenance-event``).
    It does not start the grace: such a source does not end the process itself."""
    return FLAG.record(reason, at)


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class _SigtermHandler:
    """Records the notice on the first SIGTERM and starts the grace; once the grace is
    over, re-delivers SIGTERM to the handler that was there before."""

    def __init__(self, flag: PreemptionFlag, grace_s: float, previous: _Handler) -> None:
        self.flag = flag
        self.grace_s = grace_s
        self.previous = previous
        self._grace_started = False
        self._expired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self._expired:
            self._exit_as_before(signum, frame)
            return
        self.flag.record(SIGTERM_REASON)
        if not self._grace_started:  # later SIGTERMs do not move the end of the grace
            self._grace_started = True
            # Logging and waiting happen on that thread: a handler that interrupted
            # the main thread must not take the locks of logging or of a stream.
            threading.Thread(target=self._grace, name="jaxpod-preemption-grace",
                             daemon=True).start()

    def _grace(self) -> None:
        logger.warning("SIGTERM received: preemption notice recorded; this worker exits "
                       "in %gs (%s)", self.grace_s, PREEMPTION_GRACE.env_var)
        threading.Event().wait(self.grace_s)
        self._expired = True
        if self.previous is signal.SIG_IGN:
            return  # SIGTERM did not end this process before: it does not now
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread
        threading.Event().wait(EXIT_BACKSTOP_S)
        logger.error("the previous SIGTERM handler did not end this worker within %gs "
                     "after the preemption grace; exiting", EXIT_BACKSTOP_S)
        os._exit(128 + signal.SIGTERM)

    def _exit_as_before(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)  # in a Ray worker: raises SystemExit, the worker exits
        elif previous is not signal.SIG_IGN:  # SIG_DFL, or one not set from Python
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def install_sigterm_handler(grace_s: float | None = None,
                            flag: PreemptionFlag | None = None) -> bool:
    """Makes SIGTERM record a preemption notice instead of ending the process at once.

    Args:
      grace_s: how long the process keeps running after SIGTERM (overrides
        ``JAXPOD_PREEMPTION_GRACE_S``).
      flag: where the notice goes (``None``: this process's :data:`FLAG`).

    A second call keeps the first call's handler (and its grace) and sets it again:
    call it after native code that may install its own SIGTERM handler.

    Returns:
      Whether the handler is installed (now or by an earlier call). ``False`` off the
      main thread, where SIGTERM is left as it was.

    Raises:
      ValueError: ``JAXPOD_PREEMPTION_GRACE_S`` or ``grace_s`` is not a positive number.
    """
    grace = PREEMPTION_GRACE.resolve(grace_s)
    # Python lets only the main thread set a signal handler. In a Ray worker the main
    # thread runs the task loop and Ray calls PyErr_CheckSignals there every few ms,
    # so handlers run promptly even while it is idle; a synchronous actor's __init__
    # (HostWorker's) runs on that thread, so it installs from there. An async actor's
    # __init__ runs on Ray's event-loop thread instead: there this returns False, the
    # worker keeps Ray's handler (SIGTERM ends it at once), and notices can come only
    # through record_notice. Blocking SIGTERM and sigwait-ing on a thread of our own
    # is no way out: threads Ray started before would still take the signal.
    if threading.current_thread() is not threading.main_thread():
        logger.warning("not on the main thread: SIGTERM is not turned into a "
                       "preemption notice in this process")
        return False
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, _SigtermHandler):
        # Setting it again restores Python's own C-level handler, in case native code
        # replaced it since (getsignal cannot tell): JAX's preemption service does, in
        # jax.distributed.initialize, and then swallows SIGTERM.
        signal.signal(signal.SIGTERM, current)
        return True
    signal.signal(signal.SIGTERM, _SigtermHandler(flag or FLAG, grace, current))
    return True
