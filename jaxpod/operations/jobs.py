"""What a job's runner asks of the hosts.

Their news between loops (:class:`HostReport`, answered as :class:`HostNews`) and the
job's checkpoints, written and read by each host with orbax
(:class:`SaveCheckpoint`, :class:`WaitCheckpoints`, :class:`RestoreCheckpoint`), and its
in-memory checkpoints on the hosts' nodes (:class:`SaveMemoryCheckpoint`,
:class:`MemoryHoldings`, :class:`RestoreMemoryCheckpoint`, :class:`DropMemoryCheckpoints`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from jaxpod.operations.admin import Notice
from jaxpod.operations.base import Operation
from jaxpod.operations.handles import Dropped, ValueArgs, ValueInfos, values_in

if TYPE_CHECKING:
    from jaxpod.operations.host import Host


@dataclass(frozen=True)
class HostNews:
    """What a job's runner learns from one host between loops, in one round trip: the
    lines its code printed since the last report, its input figures (as
    :class:`HostStats` has them), its preemption notice (``None``: none came) and the
    newest checkpoint step of the job that every host committed (``None``: none, or
    one is being written), the programs its process loaded from the compilation
    cache and compiled since it started (``None``: the cache is off), and the steps
    and seconds of the loops it ran to their end (as its engine's ``loop_time``
    counts them since the slice's holder took it)."""

    lines: list[str]
    input_wait_s: float
    input_queue_depth: int
    notice: Notice | None
    checkpoint: int | None = None
    programs_loaded: int | None = None
    programs_compiled: int | None = None
    loop_steps: int = 0
    loop_s: float = 0.0


@dataclass(frozen=True)
class HostReport(Operation[HostNews]):
    """The host's news for a job's runner: printed lines (taken, as
    :class:`TakeOutput` takes them), input figures, preemption notice and the job's
    committed checkpoint step (of the checkpoints under ``checkpoints``, if given)."""

    checkpoints: str | None = None
    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> HostNews:
        return host.host_report(self)


@dataclass(frozen=True)
class SaveCheckpoint(Operation[None]):
    """Starts writing a job's state as checkpoint ``step`` under ``directory`` (orbax;
    the last ``keep`` kept), with each host's input position in iterator
    ``iterator_id`` (``None``: the job has no input); returns once its bytes are off
    the devices, before they are on storage."""

    directory: str
    step: int
    keep: int
    state: ValueArgs
    iterator_id: int | None
    dispatches: ClassVar[bool] = True  # orbax synchronises the hosts

    def apply(self, host: Host) -> None:
        return host.save_checkpoint(self)


@dataclass(frozen=True)
class WaitCheckpoints(Operation["int | None"]):
    """Waits until the checkpoint writes under ``directory`` are committed; returns the
    newest committed step (``None``: none)."""

    directory: str
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> int | None:
        return host.wait_checkpoints(self)


@dataclass(frozen=True)
class RestoreCheckpoint(Operation["tuple[ValueInfos, Any]"]):
    """Restores checkpoint ``step`` under ``directory`` onto the devices: the state as
    new values (``skeleton``: its frozen structure, each leaf its index) and this
    host's input position at the step (``keep``: as the attempt's saves will)."""

    directory: str
    step: int
    keep: int
    skeleton: Any
    #: A global-view job's ``init_fn`` (by id): the leaves go where it puts them.
    init_function_id: str | None = None
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> tuple[ValueInfos, Any]:
        return host.restore_checkpoint(self)

    def created(self, result: tuple[ValueInfos, Any]) -> Dropped:
        return values_in(result[0])




@dataclass(frozen=True)
class SaveMemoryCheckpoint(Operation[None]):
    """Keeps a job's state as step ``step`` in this host's node's memory and sends a
    copy to its peer host (a collective), with this host's input position in iterator
    ``iterator_id`` (``None``: no input); returns once the copy is dispatched."""

    job: str
    step: int
    state: ValueArgs
    iterator_id: int | None
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> None:
        return host.save_memory_checkpoint(self)


@dataclass(frozen=True)
class MemoryHoldings(Operation["dict[int, dict[int, Any]]"]):
    """The steps of a job this host's node holds whole in-memory sets of, saved on the
    layout the job has here (``mesh``: a global-view job's axes, ``None``:
    per-replica): step -> {host whose shards they are: its input position}."""

    job: str
    mesh: tuple[tuple[str, int], ...] | None = None
    counts_as_work: ClassVar[bool] = False

    def apply(self, host: Host) -> dict[int, dict[int, Any]]:
        return host.memory_holdings(self)


@dataclass(frozen=True)
class RestoreMemoryCheckpoint(Operation[ValueInfos]):
    """Restores in-memory checkpoint ``step`` of a job onto the devices: host ``g``'s
    shards from the node of host ``sources[g]`` (``skeleton``, ``init_function_id``: as
    :class:`RestoreCheckpoint`'s)."""

    job: str
    step: int
    sources: tuple[int, ...]
    skeleton: Any
    init_function_id: str | None = None
    dispatches: ClassVar[bool] = True

    def apply(self, host: Host) -> ValueInfos:
        return host.restore_memory_checkpoint(self)

    def created(self, result: ValueInfos) -> Dropped:
        return values_in(result)


@dataclass(frozen=True)
class DropMemoryCheckpoints(Operation[None]):
    """Removes a job's in-memory checkpoints from this host's node (the job ended)."""

    job: str

    def apply(self, host: Host) -> None:
        return host.drop_memory_checkpoints(self)
