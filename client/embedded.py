"""The embedded local service: ``jaxpod serve --local`` as a child process.

``jaxpod.connect()`` with no address starts one for this process. The child gets a
random token, listens on a free loopback port (announced on its stdout), starts the
simulated local TPU cluster and reports ``SERVING`` on its health service when ready.
It is stopped with SIGTERM when this process exits (or killed after a grace period);
since its stdin is a pipe from this process, it also stops if this process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from jaxpod import settings
from jaxpod.errors import ServiceUnavailableError
from jaxpod.timeouts import Deadline, wait_for

START_TIMEOUT = settings.EMBEDDED_START_TIMEOUT
STOP_TIMEOUT = settings.EMBEDDED_STOP_TIMEOUT
#: The simulated slices of the embedded service (``jaxpod serve --local --slices``).
SLICES_ENV = settings.LOCAL_SLICES.name
#: How its simulated hosts run (``jaxpod serve --local --provider``); unset: plain
#: processes, which start in a second where a local Ray cluster takes five or more.
PROVIDER_ENV = settings.LOCAL_PROVIDER.name
#: The service ``jaxpod.connect()`` reaches when given no address; unset: the embedded one.
ADDRESS_ENV = settings.ADDRESS.name
_LISTENING = "JAXPOD_LISTENING"


@dataclass
class EmbeddedService:
    """An embedded service: its process, and, once :meth:`wait_ready` saw it, where it
    listens."""

    token: str
    process: subprocess.Popen[bytes]
    deadline: Deadline
    log_path: str
    state_dir: str | None = None
    quiet: bool = False
    #: Whether :func:`launch` chose the log's path (and removes it after a clean stop).
    owns_log: bool = False
    address: str = ""
    _serving: bool = field(default=False, repr=False)
    _start_failed: bool = field(default=False, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ready_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait_ready(self, serving: bool = True) -> EmbeddedService:
        """Waits until it listens and, with ``serving``, until it is ``SERVING``; the
        start time-out counts from :func:`launch`. Idempotent.

        Raises:
          ServiceUnavailableError: it exited or did not become ready in time (it is
            stopped); the message ends with the tail of its log.
        """
        with self._ready_lock:
            if self._serving or (self.address and not serving):
                return self
            try:
                if not self.address:
                    self.address = _read_address(self.process, self.deadline, self.log_path)
                if serving:
                    _wait_serving(self, self.deadline, self.log_path)
                    self._serving = True
            except BaseException:
                self._start_failed = True  # the error names its log: keep it
                self.stop(timeout_s=10)
                raise
        if not self.quiet:
            print(f"jaxpod: embedded service {'ready' if serving else 'listening'} at "
                  f"{self.address}", file=sys.stderr, flush=True)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM (graceful: sessions closed, slices released), then kill. A clean
        stop removes the log :func:`launch` made; any other end says where it is."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        proc = self.process
        killed = False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT.resolve(timeout_s))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()  # bounded: SIGKILLed just now
                killed = True
        if proc.stdin:
            proc.stdin.close()
        if proc.stdout:
            proc.stdout.close()
        if self.state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if proc.returncode == 0 and not killed and not self._start_failed:
            if self.owns_log:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.log_path)
        elif not self._start_failed:  # a failed start's error already names the log
            how = ("was killed: it did not stop in time" if killed
                   else f"exited with status {proc.returncode}")
            print(f"jaxpod: the embedded service {how}; its log is {self.log_path}",
                  file=sys.stderr, flush=True)


def start(slices: str | None = None, log_path: str | None = None,
          timeout_s: float | None = None, quiet: bool = False,
          wait_serving: bool = True) -> EmbeddedService:
    """Starts ``jaxpod serve --local`` and waits until it is serving.

    Args:
      slices: simulated slices (default ``$JAXPOD_LOCAL_SLICES``, else the service's
        default, one v4-16: 2 hosts x 4 chips).
      log_path: where the service's log goes (default: a file in the temp directory,
        removed when the service stops cleanly).
      timeout_s: overrides ``JAXPOD_EMBEDDED_START_TIMEOUT_S``.
      quiet: do not print progress to stderr.
      wait_serving: ``False``: return as soon as it listens, while its cluster may
        still be starting (calls that need the cluster wait for it on the service).

    Raises:
      ServiceUnavailableError: it exited or did not become ready in time; the message
        ends with the tail of its log.
    """
    return launch(slices, log_path, timeout_s, quiet).wait_ready(serving=wait_serving)


def launch(slices: str | None = None, log_path: str | None = None,
           timeout_s: float | None = None, quiet: bool = False) -> EmbeddedService:
    """Starts ``jaxpod serve --local`` and returns at once (arguments as :func:`start`);
    :meth:`EmbeddedService.wait_ready` waits for it."""
    deadline = Deadline(START_TIMEOUT.resolve(timeout_s))
    token = secrets.token_hex(16)
    slices = slices or settings.LOCAL_SLICES.get()
    import tempfile

    # A state dir of its own: another process's embedded service must not take this
    # one's running jobs for a crashed coordinator's. Removed when it stops.
    state_dir = tempfile.mkdtemp(prefix=f"jaxpod-embedded-{os.getpid()}-")
    # --http-port 0: a free port (a fixed one would collide between processes).
    # --prewarm: the first slice's workers start with the service, for the first
    # strategy() (which takes the first idle slice).
    command = [sys.executable, "-m", "jaxpod.cli", "serve", "--local", "--port", "0",
               "--http-port", "0", "--stop-on-stdin-eof", "--state-dir", state_dir,
               "--provider", settings.LOCAL_PROVIDER.get() or "processes", "--prewarm"]
    if slices:
        command += ["--slices", slices]
    owns_log = log_path is None
    if log_path is None:
        log_path = os.path.join(tempfile.gettempdir(), f"jaxpod-embedded-{os.getpid()}.log")
    if not quiet:
        print(f"jaxpod: starting the embedded local service (simulated "
              f"{slices or 'v4-16'}; log {log_path})...", file=sys.stderr, flush=True)
    env = {**os.environ, settings.TOKEN.name: token}
    env.pop(ADDRESS_ENV, None)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env=env, start_new_session=True)
    service = EmbeddedService(token, proc, deadline, log_path, state_dir, quiet, owns_log)
    atexit.register(service.stop)
    return service


_shared_lock = threading.Lock()
_shared: list[EmbeddedService] = []  # this process's, started on first need


def shared(wait: bool = True) -> EmbeddedService:
    """This process's embedded service, started on first need (again if it died);
    ``wait=False`` returns while it starts.

    Raises:
      ServiceUnavailableError: waiting, it exited or did not become ready in time.
    """
    with _shared_lock:
        if not _shared or _shared[0].process.poll() is not None:
            _shared[:] = [launch()]
        service = _shared[0]
    return service.wait_ready() if wait else service


def _read_address(proc: subprocess.Popen[bytes], deadline: Deadline, log_path: str) -> str:
    announced = read_announcement(proc, deadline)
    if announced is None:
        raise _failed(proc, "did not start listening", log_path)
    return str(announced["address"])


def read_announcement(proc: subprocess.Popen[bytes], deadline: Deadline
                      ) -> dict[str, Any] | None:
    """What a ``jaxpod serve`` process started with ``stdout=PIPE`` announces on its
    ``JAXPOD_LISTENING`` line (``address``, ``http``, ``pid``); ``None`` if it exits, or
    ``deadline`` passes, first."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    partial = b""  # the last line read, until its newline arrives
    try:
        while not deadline.expired():
            if selector.select(timeout=min(1.0, deadline.remaining())):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                *lines, partial = (partial + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if line.startswith(_LISTENING):
                        return dict(json.loads(line[len(_LISTENING):]))
            elif proc.poll() is not None:
                break
    finally:
        selector.close()
    return None


def _wait_serving(service: EmbeddedService, deadline: Deadline, log_path: str) -> None:
    """Follows the service's health (``Watch``: told the moment it changes, no polling
    interval) until it is ``SERVING``, it exits, or ``deadline`` passes."""
    import grpc  # here: the service is launched before gRPC loads
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(service.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not deadline.expired() and service.process.poll() is None:
            # Bounded watches: an exited service is noticed within one.
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""),
                               timeout=min(5.0, max(0.1, deadline.remaining())))
            try:
                if any(reply.status == serving for reply in watch):
                    return
            except grpc.RpcError:
                wait_for(lambda: service.process.poll() is not None, 0.1)  # paces retries
    raise _failed(service.process, "did not become ready", log_path)


def _failed(proc: subprocess.Popen[bytes], what: str, log_path: str) -> ServiceUnavailableError:
    state = (f"exited with status {proc.returncode}" if proc.poll() is not None
             else "is still running")
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4000))
            tail = f.read().decode(errors="replace")
    except OSError:
        tail = ""
    return ServiceUnavailableError(
        f"The embedded jaxpod service {what} within {START_TIMEOUT.env_var} "
        f"({state}). Its log ({log_path}) ends:\n{tail}")
