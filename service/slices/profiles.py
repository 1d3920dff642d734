"""Profiles: a ``jax.profiler`` trace on every host of a slice, on demand.

Of a job: a client asks (``job.profile(seconds)``, ``jaxpod profile``, the job's page);
the job manager hands a :class:`ProfileRequest` to the running attempt, whose runner
starts the trace on every host at its next loop boundary (:class:`Profiling`) into
``<job's checkpoint folder>/profiles/<UTC time>/host-<i>/``. Each host ends its trace
after the capture's seconds on its own clock; at the first loop boundary after that the
runner collects the trace files and answers the request.

Of an interactive strategy: ``with strategy.profile(seconds):`` starts the trace when
the block starts and ends it when the block ends (or after ``seconds``), into
``<checkpoint dir>/sessions/<session>/profiles/<UTC time>/``
(:class:`SliceProfiler`).

The trace never passes through the coordinator: the hosts write it where they write
checkpoints.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxpod import settings
from jaxpod.jobs import JobProfile, check_profile_seconds
from jaxpod.storage import join

#: How long a profile request waits beyond its seconds: for the job's next loop
#: boundary (to start) and the one after the capture (to collect the files).
PROFILE_WAIT = settings.JOB_PROFILE_WAIT
def profile_folder(parent: str, now: float) -> str:
    """Where a capture started at ``now`` goes under ``parent`` (a job's checkpoint
    folder, or a session's): ``profiles/<UTC time to the millisecond>``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return join(parent, "profiles", f"{stamp}.{int(now * 1000) % 1000:03d}Z")


class ProfileRequest:
    """One capture asked for, and its answer once the runner gives one."""

    def __init__(self, seconds: float) -> None:
        self.seconds = check_profile_seconds(seconds)
        self._done = threading.Event()
        self._profile: JobProfile | None = None
        self._error: BaseException | None = None

    def answer(self, profile: JobProfile) -> None:
        self._profile = profile
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> JobProfile:
        """The captured profile, once written.

        Raises:
          TimeoutError: no answer within the seconds plus ``JAXPOD_JOB_PROFILE_WAIT_S``.
          ValueError: the attempt ended before it could start the capture.
        """
        limit = self.seconds + PROFILE_WAIT.seconds()
        if not self._done.wait(limit):
            raise TimeoutError(
                f"The job's profile was not written within {limit:g}s (its {self.seconds:g}s "
                f"plus {PROFILE_WAIT.env_var}): its loops may be longer than that. Raise "
                f"{PROFILE_WAIT.env_var}, or ask again.")
        if self._error is not None:
            raise self._error
        assert self._profile is not None
        return self._profile


@dataclass(frozen=True)
class _Capture:
    """The capture running: the requests it answers, its folder, when it started (wall
    clock, and monotonic) and how long the hosts trace."""

    requests: list[ProfileRequest]
    folder: str
    started_at: float
    started: float
    seconds: float

    def due(self) -> bool:
        return time.monotonic() >= self.started + self.seconds

    def written(self, files: Sequence[str]) -> JobProfile:
        """The profile once the hosts wrote ``files`` (traced until now, at most its
        seconds)."""
        traced = min(self.seconds, time.monotonic() - self.started)
        return JobProfile(self.folder, self.started_at, round(traced, 3), tuple(files))


class Profiling:
    """A runner's captures: requests wait for a loop boundary; one runs at a time.

    Args:
      job_folder: the job's checkpoint folder (profiles go under it).
      clock: the wall clock (for folder names and start times).
    """

    def __init__(self, job_folder: str, clock: Callable[[], float] = time.time) -> None:
        self._job_folder = job_folder
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: list[ProfileRequest] = []
        self._running: _Capture | None = None

    @property
    def active(self) -> bool:
        """Whether a capture runs or waits (the runner looks between loops)."""
        return self._running is not None or bool(self._waiting)

    def ask(self, request: ProfileRequest) -> None:
        """Queues ``request`` for the next loop boundary (thread-safe)."""
        with self._lock:
            self._waiting.append(request)

    def at_boundary(self, start: Callable[[str, float], None],
                    stop: Callable[[], list[str]]) -> None:
        """Between two loops: collects a capture whose time is up, then starts one for
        the requests waiting (those asked together share one capture, traced as long
        as the longest asks). ``start(folder, seconds)`` and ``stop()`` reach the hosts."""
        if self._running is not None and self._running.due():
            self._collect(stop)
        with self._lock:
            if self._running is not None or not self._waiting:
                return
            requests, self._waiting = self._waiting, []
        now = self._clock()
        capture = _Capture(requests, profile_folder(self._job_folder, now), now,
                           time.monotonic(), max(r.seconds for r in requests))
        try:
            start(capture.folder, capture.seconds)
        except BaseException as e:
            for r in requests:
                r.fail(e)
            raise
        self._running = capture

    def finish(self, stop: Callable[[], list[str]], why: str) -> None:
        """The attempt ends: a running capture is collected as it is (shorter than
        asked, if it was cut), and requests that did not start fail saying ``why``."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for r in waiting:
            r.fail(ValueError(f"The job's attempt ended ({why}) before its next loop "
                              "boundary, so no profile was taken. Profile a running job."))
        if self._running is not None:
            capture = self._running
            try:
                self._collect(stop)
            except Exception as e:  # the slice may be gone
                self._running = None
                for r in capture.requests:
                    r.fail(e)

    def _collect(self, stop: Callable[[], list[str]]) -> None:
        capture = self._running
        assert capture is not None
        profile = capture.written(stop())
        self._running = None
        for r in capture.requests:
            r.answer(profile)


class SliceProfiler:
    """An interactive slice's one trace at a time (``strategy.profile``).

    Args:
      root: the session's folder (its captures go under ``root/profiles/``).
      clock: the wall clock.
    """

    def __init__(self, root: str, clock: Callable[[], float] = time.time) -> None:
        self._root = root
        self._clock = clock
        self._lock = threading.Lock()
        self._running: _Capture | None = None

    def start(self, begin: Callable[[str, float], None], seconds: float) -> JobProfile:
        """Starts tracing for at most ``seconds`` (``begin(folder, seconds)`` reaches the
        hosts); the profile's folder, with no files yet."""
        seconds = check_profile_seconds(seconds)
        with self._lock:
            if self._running is not None:
                raise ValueError(
                    f"A profile of this slice is already being taken into "
                    f"{self._running.folder}; one runs at a time. Leave its `with` block "
                    "first.")
            now = self._clock()
            capture = _Capture([], profile_folder(self._root, now), now, time.monotonic(),
                               seconds)
            begin(capture.folder, seconds)
            self._running = capture
        return JobProfile(capture.folder, now, seconds)

    def stop(self, end: Callable[[], list[str]]) -> JobProfile:
        """Ends the trace (``end()`` reaches the hosts and lists the files written)."""
        with self._lock:
            capture, self._running = self._running, None
            if capture is None:
                raise ValueError("No profile of this slice is being taken: start one with "
                                 "`with strategy.profile(seconds):`.")
            return capture.written(end())
