"""Helpers shared by the benchmark scripts: timing and the one-line JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import httpx

from jaxpod.client.embedded import read_announcement
from jaxpod.timeouts import Deadline, wait_for


def use_cpu_devices(count: int) -> None:
    """Makes JAX (not yet started) run on ``count`` simulated CPU devices."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def call_times(fn: Callable[[], Any], repeats: int, warmup: int = 1, idle_s: float = 0.0
               ) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn()`` in seconds, after ``warmup`` calls;
    each timed call after ``idle_s`` seconds asleep (untimed)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup``."""
    return statistics.median(call_times(fn, repeats, warmup))


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
                        ) -> dict[str, float]:
    """Median times of several candidates measured in alternation.

    Alternating the candidates spreads machine noise (other processes, frequency
    changes) over all of them, so their ratio is fairer than back-to-back runs.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used so far (user, system and
    interrupt time, from Linux's ``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of process ``pid`` in MiB: ``VmRSS`` (resident now) or
    ``VmHWM`` (its peak so far), from ``/proc/<pid>/status``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field} line")


def peak_rss_growth_mib(pid: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """How far process ``pid``'s peak resident memory rose above its resident memory
    at the start while ``fn()`` ran (Linux's ``clear_refs`` resets the peak first), and
    what ``fn`` returned."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = memory_mib(pid)
    out = fn()
    return memory_mib(pid, "VmHWM") - before, out


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (user and system, all its threads;
    0 once it is gone), from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_machine_cpu(fn: Callable[[], Any], spent: list[float]) -> Callable[[], Any]:
    """``fn``, appending to ``spent`` the machine's CPU seconds each call used: with
    several processes on one call's path, the work that the wall time alone hides."""
    def measured() -> Any:
        before = machine_cpu_s()
        try:
            return fn()
        finally:
            spent.append(machine_cpu_s() - before)

    return measured


def target(value: float, op: str, bound: float) -> dict[str, Any]:
    """One entry of the report's ``targets``: ``op`` is ``"<="``, ``"<"``, ``">="``."""
    met = {"<=": value <= bound, "<": value < bound, ">=": value >= bound}[op]
    return {"value": round(value, 4), "target": f"{op} {bound}", "met": bool(met)}


def report(name: str, figures: dict[str, Any], targets: dict[str, Any]) -> None:
    """Prints the report as the last line of output."""
    print(json.dumps({"benchmark": name, "figures": figures, "targets": targets}))


def parse_parts(parser: Any, parts: tuple[str, ...]) -> Any:
    """Adds ``--quick`` and ``--parts`` to ``parser`` and parses the command line;
    ``args.parts`` becomes the set of parts chosen (an error names the known ones)."""
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--parts", default=",".join(parts),
                        help=f"what to measure, comma-separated (default all: "
                             f"{','.join(parts)})")
    args = parser.parse_args()
    chosen = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not chosen or chosen - set(parts):
        parser.error(f"--parts: expected some of {','.join(parts)}; got {args.parts!r}")
    args.parts = chosen
    return args


def log_tail(path: str, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a log file, for an error message."""
    try:
        with open(path, "rb") as f:
            return f.read()[-limit:].decode(errors="replace")
    except OSError:
        return "(no log)"


def stop_process(proc: Any, timeout_s: float) -> None:
    """SIGTERM (a graceful stop), then kill after ``timeout_s``; closes its pipes."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``condition()``'s first truthy value, polled every 10 ms; raises naming ``what``
    if ``timeout_s`` passes first."""
    got = wait_for(condition, timeout_s, poll_s=0.01, max_poll_s=0.01)
    if not got:
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
    return got


def follow_job(job: Any, on_status: Callable[[Any], None], timeout_s: float
               ) -> list[tuple[float, Any]]:
    """``(client wall time, status)`` per change of ``job`` until it ends, calling
    ``on_status`` on each; the job is cancelled after ``timeout_s`` and must succeed."""
    import threading

    timer = threading.Timer(timeout_s, job.cancel)
    timer.daemon = True
    timer.start()
    seen: list[tuple[float, Any]] = []
    try:
        for status in job.watch():
            seen.append((time.time(), status))
            on_status(status)
    finally:
        timer.cancel()
    final = seen[-1][1]
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"job {job.id} ended {final.state}: {final.error}")
    return seen


def free_port() -> int:
    """A TCP port free on loopback now (for a ``jax.distributed`` coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(module: str, call: str, argvs: list[list[str]], timeout_s: float
                  ) -> list[str]:
    """Runs ``call`` (e.g. ``"f(*sys.argv[1:])"``) from benchmark ``module`` in one fresh
    interpreter per entry of ``argvs`` (its ``sys.argv[1:]``), at once; their outputs.

    Raises:
      RuntimeError: a process failed (with every output).
    """
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import {module}; {module}.{call}"
    procs = [subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE,
                              text=True) for argv in argvs]
    outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the {module} processes failed: {outs}")
    return outs


class CommandChild:
    """A benchmark's own script run again as a child process (``--_inprocess`` and
    ``args``), driven by one command per line on stdin; it prints ``READY`` once, then
    answers each command with a line ``T <number>...``. Started without jaxpod's and
    XLA's variables, as a fresh user process."""

    def __init__(self, script: str, args: list[str]) -> None:
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAXPOD_", "XLA_FLAGS"))}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--_inprocess",
                                      *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)

    def _answer(self, prefix: str) -> list[str]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.split()[1:]
        raise RuntimeError(f"the child process exited with status {self.proc.wait()}")

    def wait_ready(self) -> None:
        self._answer("READY")

    def ask(self, command: str) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return [float(x) for x in self._answer("T ")]

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


#: How long a benchmark waits for its ``jaxpod serve`` to start, and to stop.
SERVE_START_S, SERVE_STOP_S = 300.0, 90.0


class ServeProcess:
    """``jaxpod serve --local --slices SLICES --provider PROVIDER`` with free gRPC and
    HTTP ports, its own token, state dir and in-memory checkpoint folder (removed when
    it stops): the service as users run it."""

    def __init__(self, log_path: str, slices: str, tls: bool = False,
                 provider: str = "ray", state_dir: str | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.token = secrets.token_hex(16)
        #: A state dir of its own (removed at stop) unless ``state_dir`` is given.
        self._owns_state = state_dir is None
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="jaxpod-bench-dashboard-")
        self.log_path = log_path
        env = {**os.environ, **(env or {}), "JAXPOD_TOKEN": self.token}
        env.pop("JAXPOD_ADDRESS", None)
        #: The hosts' in-memory checkpoints, in RAM as by default but in a folder of its
        #: own (removed at stop), unless the caller names one: nothing is left behind.
        self._memory_dir: str | None = None
        if "JAXPOD_MEMORY_CHECKPOINT_DIR" not in env:
            self._memory_dir = env["JAXPOD_MEMORY_CHECKPOINT_DIR"] = tempfile.mkdtemp(
                prefix="jaxpod-bench-memory-",
                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        command = [sys.executable, "-m", "jaxpod.cli", "serve", "--local", "--slices", slices,
                   "--provider", provider, "--port", "0", "--http-port", "0",
                   "--stop-on-stdin-eof", "--state-dir", self.state_dir, *args]
        #: The certificate clients trust (self-signed, for 127.0.0.1), with --tls.
        self.ca: bytes | None = None
        if tls:
            cert, key = (os.path.join(self.state_dir, n) for n in ("cert.pem", "key.pem"))
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                            "-subj", "/CN=jaxpod bench", "-addext",
                            "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                           check=True, capture_output=True)
            with open(cert, "rb") as f:
                self.ca = f.read()
            command += ["--tls-cert", cert, "--tls-key", key]
        #: What HTTP clients verify the service with.
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cadata=self.ca.decode()) if self.ca else True)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True)
        try:
            deadline = Deadline(SERVE_START_S)
            announced = self._announced(deadline)
            scheme = "https" if tls else "http"
            self.address, self.http = announced["address"], f"{scheme}://{announced['http']}"
            ready = wait_for(self._ready, deadline.remaining(), max_poll_s=0.5)
            if not ready:
                raise RuntimeError(f"jaxpod serve was not ready in {SERVE_START_S:g}s:\n"
                                   f"{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _announced(self, deadline: Deadline) -> dict[str, str]:
        announced = read_announcement(self.process, deadline)
        if announced is None:
            raise RuntimeError(f"jaxpod serve did not start listening:\n{self.log_tail()}")
        return announced

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"jaxpod serve exited:\n{self.log_tail()}"
        try:
            return httpx.get(self.http + "/readyz", timeout=5,
                             verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, limit: int = 4000) -> str:
        return log_tail(self.log_path, limit)

    def stop(self) -> None:
        stop_process(self.process, SERVE_STOP_S)
        if self._owns_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if self._memory_dir is not None:
            shutil.rmtree(self._memory_dir, ignore_errors=True)


@contextlib.contextmanager
def kept_log_on_failure(service: Any, log_path: str) -> Iterator[Any]:
    """``service`` (a started ``jaxpod serve`` with ``log_tail`` and ``stop``) for the
    ``with`` block: stopped after it, its log printed and kept if the block failed,
    else removed."""
    try:
        yield service
    except BaseException:
        print(f"jaxpod serve log (kept at {log_path}):\n{service.log_tail()}", flush=True)
        raise
    finally:
        service.stop()
    os.unlink(log_path)
