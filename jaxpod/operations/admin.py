"""Operations on the hosts themselves rather than on values.

What a host holds and how long it worked (:class:`Stats`), its reset for the slice's
next holder (:class:`ResetHost`), the output its code prints
(:class:`CaptureOutput`, :class:`TakeOutput`), ``jax.profiler`` traces and its notice
of a coming preemption (:class:`PreemptionNotices`), with the results they answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from jaxpod.operations.base import Operation

if TYPE_CHECKING:
    from jaxpod.operations.host import Host


@dataclass(frozen=True)
class HostStats:
    """What one host holds, and the time it spent working: its operations (other than
    ``Stats``) and the computations they dispatched, measured inside the worker; and its
    input feed: the seconds its steps waited for input that was not ready
    (``input_wait_s``) and the chunks of steps its infeeds have placed on the devices
    now (``input_queue_depth``; not those read ahead into host memory only). Times count
    from the slice's current holder."""

    num_values: int
    device_bytes: int
    num_iterators: int
    busy_s: float
    operations: int
    input_wait_s: float
    input_queue_depth: int


@dataclass(frozen=True)
class HostReset:
    """What :class:`ResetHost` freed on one host, and what it kept for the next holder."""

    values: int
    datasets: int
    iterators: int
    functions_kept: int
    pid: int


@dataclass(frozen=True)
class Notice:
    """A host's notice of a coming preemption: when it came (wall-clock seconds, as
    ``time.time()``) and from where (``"SIGTERM"``, or another source's reason)."""

    at: float
    reason: str


@dataclass(frozen=True)
class Stats(Operation[HostStats]):
    """What the host holds and how long it worked."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostStats:
        return host.stats(self)


@dataclass(frozen=True)
class ResetHost(Operation[HostReset]):
    """Frees every value, dataset and iterator, zeroes the work figures and stops
    capturing output (discarding it), keeping the defined (and compiled) functions: the
    slice's next holder starts on warm workers."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostReset:
        return host.reset_host(self)


@dataclass(frozen=True)
class CaptureOutput(Operation[None]):
    """Starts (``enabled``) or stops keeping what the host's code prints on stdout and
    stderr; starting while capturing keeps the one capture. Stopping keeps what was
    captured (an unfinished last line becomes a line) until it is taken."""

    enabled: bool
    counts_as_work: ClassVar[bool] = False  # bookkeeping, as Stats: no busy time

    def apply(self, host: Host) -> None:
        return host.capture_output(self)


@dataclass(frozen=True)
class TakeOutput(Operation["list[str]"]):
    """The complete lines the host printed since the last take, in order (stdout and
    stderr together). Text ``jax.debug.print`` writes comes when the computation
    that prints it runs: it may come with a later take."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> list[str]:
        return host.take_output(self)


@dataclass(frozen=True)
class StartProfile(Operation[None]):
    """Starts a ``jax.profiler`` trace into ``<folder>/host-<i>`` on every host; each
    host ends it after ``seconds``."""

    folder: str
    seconds: float
    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> None:
        return host.start_profile(self)


@dataclass(frozen=True)
class StopProfile(Operation["list[str]"]):
    """Ends the host's trace if it still runs; the trace files it wrote."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> list[str]:
        return host.stop_profile(self)


@dataclass(frozen=True)
class PreemptionNotices(Operation["Notice | None"]):
    """The host's notice of a coming preemption (``None``: none came). No device work:
    the coordinator asks after every on-device loop and before keeping a slice warm."""

    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> Notice | None:
        return host.preemption_notices(self)


