"""``HostWorker``: one JAX process of a multi-host replica group (a Ray actor).

Every host of an allocated slice runs one ``HostWorker``. Host 0 picks the
coordinator port, all hosts join one ``jax.distributed`` group, and each then runs the
same :class:`~jaxpod.worker.engine.Engine` over the global mesh. The coordinator talks
to the workers only through :class:`~jaxpod.service.slices.replica_group.ReplicaGroup`, which
numbers every operation so that a skipped or reordered call is detected here instead
of deadlocking a collective.

The actor only starts, connects and stops the host's process; the operations
themselves run in :class:`~jaxpod.worker.host_operations.HostOperations`, reached over
the operation channel (:mod:`jaxpod.worker.channel`), not through Ray.

SIGTERM does not end a worker at once: it records a preemption notice and the worker
exits after a grace (:mod:`jaxpod.worker.preemption`).
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import TYPE_CHECKING

from jaxpod import settings
from jaxpod.operations import RemoteError

if TYPE_CHECKING:
    from jaxpod.worker.channel import ChannelAddress, ChannelServer
    from jaxpod.worker.host_operations import HostOperations

SIMULATED_PLATFORM = "cpu"
#: Pins host 0's ``jax.distributed`` coordinator port (``deploy/`` sets it on every TPU
#: pod and declares the port), so firewall rules and manifests name the port in use.
COORDINATOR_PORT_ENV = settings.COORDINATOR_PORT.name


class HostWorker:
    """Runs engine operations for one host. Construct through ``ray.remote``.

    Args:
      process_id: this host's index in the group (its TPU worker id).
      num_processes: hosts in the group.
      devices_per_host: JAX devices each host has (simulated hosts: one CPU device
        per chip).
      platform: ``"cpu"`` for simulated hosts; ``"tpu"`` on real TPU hosts.
      env: variables to set before JAX starts (the host's ``TPU_*``/``MEGASCALE_*``).
      unset_env: variables to remove first (stale ones a ``runtime_env`` cannot drop).
    """

    def __init__(self, process_id: int, num_processes: int, devices_per_host: int,
                 platform: str = SIMULATED_PLATFORM, env: dict[str, str] | None = None,
                 unset_env: tuple[str, ...] = ()) -> None:
        for name in unset_env:
            os.environ.pop(name, None)
        os.environ.update(env or {})
        settings.check_once()
        from jaxpod.worker import preemption

        # SIGTERM (a Kubernetes eviction, a GCE maintenance event) becomes a notice the
        # coordinator asks for, instead of Ray's handler ending the process at once.
        # A synchronous actor's __init__ runs on the main thread, where this is allowed.
        preemption.install_sigterm_handler()
        import jax

        if platform == SIMULATED_PLATFORM:
            # Must happen before JAX starts its backend: one virtual device per chip,
            # and gloo for cross-process collectives on CPU (only across processes: in
            # one process XLA's own collectives are an order of magnitude faster).
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", devices_per_host)
            if num_processes > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's own preemption service would take SIGTERM with a native handler (in
        # jax.distributed.initialize), swallow it, and tell only its sync-point API,
        # which a coordinator-driven loop never calls: the notice is ours to report.
        jax.config.update("jax_enable_preemption_service", False)
        from jaxpod.worker import compile_cache

        # Before anything compiles: a restarted attempt loads its programs.
        compile_cache.enable(every_process_writes=platform == SIMULATED_PLATFORM)
        self.process_id = process_id
        self.num_processes = num_processes
        self._host: HostOperations | None = None
        self._channel: ChannelServer | None = None

    # ------------------------------------------------------------------ start/stop
    def node_address(self) -> str:
        """The address other hosts reach this one at."""
        import ray

        return str(ray.util.get_node_ip_address())

    def reserve_port(self) -> int:
        """The TCP port on this host for the jax.distributed coordinator:
        ``$JAXPOD_COORDINATOR_PORT`` when set, else a free one."""
        pinned = settings.COORDINATOR_PORT.get()
        if pinned is not None:
            return int(pinned)
        with socket.socket() as s:
            s.bind((self.node_address(), 0))
            return int(s.getsockname()[1])

    def initialize(self, coordinator_address: str, timeout_s: float) -> dict[str, int]:
        """Joins the group; raises if the other hosts do not join within ``timeout_s``."""
        import jax

        if self.num_processes > 1:  # a single-host slice needs no distributed runtime
            jax.distributed.initialize(coordinator_address=coordinator_address,
                                       num_processes=self.num_processes,
                                       process_id=self.process_id,
                                       initialization_timeout=max(1, int(timeout_s)))
        from jaxpod.worker import preemption
        from jaxpod.worker.engine import Engine
        from jaxpod.worker.host_operations import HostOperations

        self._host = HostOperations(self.process_id, Engine(), self.num_processes)
        # Again, now the distributed runtime and the backend have started: native code
        # may have put its own SIGTERM handler in place of Python's.
        preemption.install_sigterm_handler()
        return {"process_index": jax.process_index(), "process_count": jax.process_count(),
                "global_devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "num_replicas": self._host.engine.num_replicas_in_sync,
                "pid": os.getpid(), "node": socket.gethostname(),
                "address": self.node_address()}

    def open_channel(self, key: bytes) -> ChannelAddress:
        """Starts serving operations over a direct socket (see
        :mod:`jaxpod.worker.channel`); returns its address."""
        from jaxpod.worker.channel import ChannelServer

        if self._host is None:
            raise RuntimeError("open_channel: initialize the worker first.")
        self._channel = ChannelServer(self.node_address(), key, self._host.execute,
                                      lambda e: RemoteError.of(e, traceback.format_exc()))
        return self._channel.address

    def stacks(self) -> str:
        """Every thread's Python stack in this worker (:mod:`jaxpod.worker.stacks`):
        answered while an operation runs, since operations run on the channel's
        thread."""
        from jaxpod.worker.stacks import python_stacks

        return python_stacks()

    def shutdown(self) -> None:
        """Leaves the group (called with a time limit by the coordinator)."""
        import jax

        if self._channel is not None:
            self._channel.close()
        if self._host is not None:
            self._host.close()
        if self.num_processes > 1:
            jax.distributed.shutdown()
