"""The simulated local TPU cluster: a Ray cluster on 127.0.0.1 whose nodes are TPU hosts.

Each simulated host is its own Ray node (raylet). It is started with the environment
a GKE TPU pod has (``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_ACCELERATOR_TYPE``,
``TPU_TOPOLOGY``, ``TPU_WORKER_HOSTNAMES``) and ``TPU: <chips>``, so Ray's own TPU
detection gives it exactly the resources and labels a real TPU host has
(``TPU-v4-16-head`` on worker 0, the slice-name resource, ``ray.io/tpu-slice-name``,
``ray.io/tpu-worker-id``, ``ray.io/tpu-pod-type``, ``ray.io/tpu-topology``, ...).
Tasks and actors on a simulated host inherit that environment plus
``JAX_PLATFORMS=cpu`` and ``JAX_NUM_CPU_DEVICES=<devices per host>``: JAX runs on
CPU with one virtual device per chip.

The nodes live in a launcher subprocess (``python -m jaxpod.service.capacity.local_cluster``)
that holds a ``ray.cluster_utils.Cluster``. The launcher runs with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (set before it imports Ray) so every node binds
127.0.0.1, reports the GCS address on stdout, and tears the cluster down when told to
or when its stdin closes, which also happens when its parent dies, however it dies.
:meth:`LocalTPUCluster.stop` then checks every process that was started under the
launcher is gone, killing stragglers by pid.

A driver process needs the same loopback setting to reach a GCS on 127.0.0.1 (Ray
otherwise rewrites ``127.0.0.1`` to the host's network address):
:func:`jaxpod.service.capacity.resolvers.ray.connect` applies its ``use_loopback`` for loopback
addresses.

Usage::

    with LocalTPUCluster("v4-16,v4-8") as cluster:
        cluster.connect()      # this process becomes a driver (or: RAY_ADDRESS=cluster.address)
        ...
        ray.shutdown()
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from jaxpod import settings
from jaxpod.service.capacity.resolvers.base import LOOPBACK_ENV
from jaxpod.service.capacity.topology import SliceShape, slice_shape
from jaxpod.timeouts import Deadline, wait_for

logger = logging.getLogger(__name__)

START_TIMEOUT = settings.LOCAL_CLUSTER_START_TIMEOUT
STOP_TIMEOUT = settings.LOCAL_CLUSTER_STOP_TIMEOUT
#: The embedded default: one v4-16 slice, 2 hosts x 4 chips.
DEFAULT_SLICES = "v4-16"
LOOPBACK = "127.0.0.1"
_MB = 1024 * 1024


@dataclass(frozen=True)
class SimulatedSlice:
    """One simulated slice.

    Attributes:
      name: its slice name (``TPU_NAME``), ``sim-<index>-<type>``.
      shape: its row of the topology table.
    """

    name: str
    shape: SliceShape

    def host_env(self, worker_id: int) -> dict[str, str]:
        """The environment of simulated host ``worker_id``: GKE's TPU variables plus JAX on CPU.

        Args:
          worker_id: the host's index in the slice.

        Returns:
          Variables for the host's raylet, which its workers inherit.
        """
        return {
            "TPU_NAME": self.name,
            "TPU_WORKER_ID": str(worker_id),
            "TPU_ACCELERATOR_TYPE": self.shape.accelerator_type,
            "TPU_TOPOLOGY": self.shape.topology,
            "TPU_WORKER_HOSTNAMES": ",".join([LOOPBACK] * self.shape.num_hosts),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(self.shape.devices_per_host),
        }


def plan_slices(spec: str | Sequence[str]) -> tuple[SimulatedSlice, ...]:
    """Parses ``"v4-16,v4-8"`` (or a list of types) into named simulated slices.

    Raises:
      ValueError: an empty spec or an unknown accelerator type.
    """
    types = spec.split(",") if isinstance(spec, str) else list(spec)
    types = [t.strip() for t in types if t.strip()]
    if not types:
        raise ValueError(
            f"--slices {spec!r} names no slice. Expected accelerator types joined by ',', "
            f"e.g. '{DEFAULT_SLICES},v4-8'."
        )
    shapes = [slice_shape(t) for t in types]
    return tuple(SimulatedSlice(f"sim-{i}-{s.accelerator_type}", s) for i, s in enumerate(shapes))


@dataclass(frozen=True)
class NodeOptions:
    """Sizes of the simulated nodes (kept small: many raylets share one machine).

    Attributes:
      cpus_per_host: logical CPUs of each simulated TPU host.
      head_cpus: logical CPUs of the head node (no TPUs, like a KubeRay head).
      object_store_mb: object store of each node, in MiB.
    """

    cpus_per_host: int = 1
    head_cpus: int = 1
    # Room for a few hundred MiB of results in flight (a 256 MiB gather) without
    # spilling to disk; shared memory is only committed when used.
    object_store_mb: int = 512


class LocalTPUCluster:
    """A local Ray cluster of simulated TPU hosts; a context manager.

    Attributes:
      slices: the simulated slices.
      options: node sizes.
    """

    def __init__(
        self,
        slices: str | Sequence[str] = DEFAULT_SLICES,
        *,
        options: NodeOptions | None = None,
        start_timeout_s: float | None = None,
        stop_timeout_s: float | None = None,
    ) -> None:
        """Args:
        slices: accelerator types, ``"v4-16,v4-8"`` or ``["v4-16", "v4-8"]``.
        options: node sizes; :class:`NodeOptions` defaults when ``None``.
        start_timeout_s: start-up limit (``JAXPOD_LOCAL_CLUSTER_START_TIMEOUT_S``).
        stop_timeout_s: tear-down limit (``JAXPOD_LOCAL_CLUSTER_STOP_TIMEOUT_S``).
        """
        self.slices = plan_slices(slices)
        self.options = options or NodeOptions()
        self._start_timeout_s = START_TIMEOUT.resolve(start_timeout_s)
        self._stop_timeout_s = STOP_TIMEOUT.resolve(stop_timeout_s)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._ready: dict[str, Any] = {}
        self._started = 0.0  # when launch() started the launcher (monotonic)

    @property
    def address(self) -> str:
        """The GCS address, ``127.0.0.1:<port>``: pass to ``ray.init`` or set as ``RAY_ADDRESS``."""
        if not self._ready:
            raise RuntimeError("The local TPU cluster is not running; call start() first.")
        return str(self._ready["address"])

    @property
    def pid(self) -> int | None:
        """Pid of the launcher process, while it runs."""
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        """Whether the launcher is up and reported the cluster ready."""
        return bool(self._ready) and self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """Variables a process needs to use this cluster: ``{"RAY_ADDRESS": address}``."""
        return {"RAY_ADDRESS": self.address}

    def connect(self) -> None:
        """Connects this process to the cluster as a Ray driver (loopback mode included).

        Call ``ray.shutdown()`` before :meth:`stop`.
        """
        from jaxpod.service.capacity.resolvers.ray import connect

        connect(self.address)

    def start(self) -> LocalTPUCluster:
        """Starts the launcher and waits until every simulated host has joined.

        Returns:
          ``self``.

        Raises:
          TimeoutError: not ready within the start time-out (named in the message).
          RuntimeError: the launcher failed; the message carries its log's tail.
        """
        return self.launch().wait_ready()

    def launch(self) -> LocalTPUCluster:
        """Starts the launcher and returns at once: the cluster comes up while the
        caller does other work; :meth:`wait_ready` waits for it.

        Returns:
          ``self``.
        """
        if self._proc is not None:
            raise RuntimeError("This LocalTPUCluster was already started.")
        # The launcher's log: an already-unlinked file, so nothing is left on disk
        # whatever happens to this process; stop() closes it.
        self._log = tempfile.TemporaryFile(prefix="jaxpod-local-cluster-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            self._command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **LOOPBACK_ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
            start_new_session=True,
        )
        self._started = time.monotonic()
        return self

    def wait_ready(self) -> LocalTPUCluster:
        """Waits until every simulated host has joined (the start time-out counts from
        :meth:`launch`); stops the cluster if it does not.

        Returns:
          ``self``.

        Raises:
          TimeoutError: not ready within the start time-out (named in the message).
          RuntimeError: the launcher failed, or was never launched; the message
            carries its log's tail.
        """
        if self._ready:
            return self
        if self._proc is None:
            raise RuntimeError("This LocalTPUCluster was not launched; call start().")
        try:
            self._ready = self._read_ready(
                max(0.0, self._start_timeout_s - (time.monotonic() - self._started)))
        except BaseException:
            self.stop()
            raise
        return self

    def _command(self) -> list[str]:
        o = self.options
        return [
            sys.executable, "-m", "jaxpod.service.capacity.local_cluster",
            "--slices", ",".join(s.shape.accelerator_type for s in self.slices),
            "--cpus-per-host", str(o.cpus_per_host),
            "--head-cpus", str(o.head_cpus),
            "--object-store-mb", str(o.object_store_mb),
            "--timeout-s", str(self._start_timeout_s),
        ]

    def _read_ready(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        line = _read_line(self._proc.stdout, timeout_s)
        if line is None and self._proc.poll() is None:
            raise TimeoutError(
                f"The simulated TPU cluster ({self._describe()}) did not start within "
                f"{self._start_timeout_s:g} s ({START_TIMEOUT.env_var}). Log tail:\n"
                f"{self._log_tail()}"
            )
        if not line:
            raise RuntimeError(
                # bounded: its output ended, so it exited
                f"The simulated TPU cluster launcher exited with code {self._proc.wait()} "
                f"before it was ready. Log tail:\n{self._log_tail()}"
            )
        return dict(json.loads(line))

    def stop(self) -> None:
        """Stops the cluster; every process started under the launcher is gone on return.

        Idempotent. Raises nothing for a cluster that already stopped.

        Raises:
          RuntimeError: a process would not die even after SIGKILL (reported by pid).
        """
        proc, self._proc = self._proc, None
        self._ready = {}
        if proc is None:
            return
        tree = descendants(proc.pid)
        _ask_to_stop(proc)
        if not _wait_exit(proc, self._stop_timeout_s):
            logger.warning("Local TPU cluster launcher %d did not stop in time; killing", proc.pid)
            _kill_and_reap(proc)
        leftovers = _reap_tree(tree, self._stop_timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        if leftovers:
            raise RuntimeError(
                f"Processes of the simulated TPU cluster survived SIGKILL: {leftovers}."
            )

    def _describe(self) -> str:
        return ", ".join(s.shape.accelerator_type for s in self.slices)

    def _log_tail(self, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
        if self._log is None:
            return "(no log)"
        fd = self._log.fileno()
        size = os.fstat(fd).st_size
        # pread leaves the offset the launcher shares with us (and keeps writing at) alone.
        data = os.pread(fd, max_bytes, max(0, size - max_bytes))
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalTPUCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self._ready.get("address", "not running")
        return f"LocalTPUCluster({self._describe()!r}, {where})"


def _read_line(stream: IO[bytes], timeout_s: float) -> str | None:
    """One line from ``stream``; ``None`` on time-out, ``""`` at end of stream."""
    deadline = Deadline(timeout_s)
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while not deadline.expired():
            if not selector.select(deadline.remaining()):
                continue
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return ""
            buffer += chunk
            if b"\n" in buffer:
                return buffer.split(b"\n", 1)[0].decode()
    return None


def _ask_to_stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.write(b"stop\n")
        proc.stdin.close()


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    return True


def _kill_and_reap(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()  # bounded: SIGKILLed just now


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``, with its start time (to tell reused pids apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        child = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(child)
        starts[child] = fields[19]
    found: dict[int, str] = {}
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found[child] = starts[child]
        stack.extend(children.get(child, []))
    return found


def is_running(pid: int, start: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == start and fields[0] != "Z"


def _reap_tree(tree: Mapping[int, str], timeout_s: float) -> list[int]:
    """Waits for the processes in ``tree`` to exit; SIGKILLs those that do not.

    Returns:
      Pids still alive after SIGKILL (normally none).
    """
    def all_gone() -> bool:
        return not any(is_running(p, s) for p, s in tree.items())

    if wait_for(all_gone, timeout_s):
        return []
    for pid, start in tree.items():
        if is_running(pid, start):
            logger.warning("Killing leftover local-cluster process %d", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    wait_for(all_gone, 10.0)
    return [p for p, s in tree.items() if is_running(p, s)]


# ----------------------------------------------------------------------------------
# The launcher: ``python -m jaxpod.service.capacity.local_cluster`` (runs in the subprocess).
# ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Sets variables for the duration of one ``add_node`` (the launcher is single-threaded)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _launch(args: argparse.Namespace, report: IO[str]) -> None:
    """Starts the cluster, reports it, and blocks until told to stop."""
    from ray.cluster_utils import Cluster

    slices = plan_slices(args.slices)
    store = args.object_store_mb * _MB
    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    try:
        cluster.add_node(
            num_cpus=args.head_cpus, object_store_memory=store, include_dashboard=False,
            dashboard_port=_free_port(), dashboard_agent_listen_port=None,
            node_ip_address=LOOPBACK, no_monitor=True,  # a fixed cluster: no autoscaler
        )
        for s in slices:
            for worker_id in range(s.shape.num_hosts):
                with _environ(s.host_env(worker_id)):
                    cluster.add_node(
                        num_cpus=args.cpus_per_host, resources={"TPU": s.shape.chips_per_host},
                        object_store_memory=store, node_ip_address=LOOPBACK, wait=False,
                    )
        cluster.wait_for_nodes(timeout=args.timeout_s)
        report.write(json.dumps({
            "address": cluster.address,
            "slices": [{"name": s.name, "accelerator_type": s.shape.accelerator_type}
                       for s in slices],
        }) + "\n")
        report.flush()
        for line in sys.stdin:
            if line.strip() == "stop":
                break
    finally:
        cluster.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Launcher entry point; the protocol is one JSON line on stdout, ``stop`` on stdin."""
    parser = argparse.ArgumentParser(prog="python -m jaxpod.service.capacity.local_cluster")
    parser.add_argument("--slices", default=DEFAULT_SLICES)
    parser.add_argument("--cpus-per-host", type=int, default=1)
    parser.add_argument("--head-cpus", type=int, default=1)
    parser.add_argument("--object-store-mb", type=int, default=80)
    parser.add_argument("--timeout-s", type=float, default=START_TIMEOUT.default_s)
    args = parser.parse_args(argv)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        print("The launcher must run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 so Ray binds "
              "127.0.0.1; start it through LocalTPUCluster.", file=sys.stderr)
        return 2
    # Keep stdout for the protocol; anything else printed goes to the log (stderr).
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _launch(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
