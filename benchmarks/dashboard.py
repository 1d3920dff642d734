"""The HTTP API under pollers: latency of ``GET /api/v1/jobs`` and what polling costs a
running job.

A real ``jaxpod serve --local`` (one simulated v4-8: 1 host, 4 chips; its own token,
state dir and free ports) runs one long job: a data-parallel matmul step
(``steps_per_run`` steps per loop, its loss recorded as a metric every loop). While it
runs, the job's rate is measured in alternating phases of ``--phase-s`` seconds (10;
3 with ``--quick``): ``quiet`` (no HTTP traffic) and ``polled`` (32 concurrent
pollers, each on its own keep-alive connection, each sending ``GET /api/v1/jobs`` with
the bearer token every ``--interval-s``, 1 s as the page does; a poller that falls
behind sends its next request at once): quiet, then ``--rounds`` (6; 2 with
``--quick``) pairs of polled and quiet, so every polled phase has a quiet one on each
side. The pollers speak bare HTTP/1.1 on asyncio streams, the leanest client there is:
they share the machine's cores with the service and the job.

On a TPU slice the job's host workers run on the slice's hosts, never on the
coordinator's cores, so what the dashboard can cost a job is the coordinator's time
between loops. Here the simulated hosts share this machine's cores with the service,
so by default (``--cores apart``) the benchmark models the deployment: once the job
runs it pins the job's host-worker processes (``ray::HostWorker``) to the last core
and everything else of the service (the coordinator, Ray's daemons) and the pollers to
the others. ``--cores shared`` leaves every process on every core: then the pollers
and the HTTP server take CPU from the job's workers themselves.

Figures:

* ``p50_ms``, ``p99_ms``, ``max_ms``: client-side wall time of every poll (send to
  whole body read), over all polled phases; ``requests``, ``errors`` (transport
  errors and non-200 answers), ``requests_per_s``. ``server_p99_ms_at_most``: the
  service's own p99 for the route (arrival to last byte, from its
  ``jaxpod_http_request_duration_seconds`` histogram: the upper bound of the bucket
  it falls in), which leaves out the client's side and the network stack.
* ``cpus``, ``load_avg_1m`` (at the start and the end): how busy the machine was; on
  a shared machine other processes' load shows in the tails and the rates.
  ``pollers_cpu_s_per_s``: CPU seconds per second the pollers themselves (this
  process) used: they share the machine with the service and the job's workers, where
  a dashboard's browsers would not. ``service_cpu_s_per_s_quiet`` and
  ``service_cpu_s_per_s_polled``: the same for the ``jaxpod serve`` process (it runs
  the job's loop and the HTTP server), in each kind of phase.
* ``steps_per_s_quiet`` and ``steps_per_s_polled``: the job's steps over each phase
  (its step read over gRPC at the phase's start and end), summed over phases.
  ``polled_vs_quiet``: the median over polled phases of the phase's rate over the mean
  rate of the quiet phases either side of it (the job's rate drifts by several percent
  over minutes on a shared machine: neighbours compare like with like);
  ``polled_vs_quiet_each``: those ratios; ``polled_vs_quiet_pooled``: polled / quiet
  over all phases. ``cores``: ``apart`` (with ``host_worker_cpus`` and
  ``service_cpus``) or ``shared``.

Targets: p99 < 50 ms, zero errors, ``polled_vs_quiet`` >= 0.95.

``--tls`` serves gRPC and HTTP over TLS (a self-signed certificate for 127.0.0.1): the
pollers then hold TLS connections, as browsers of a TLS deployment do.

Usage: python benchmarks/dashboard.py [--quick] [--tls] [--pollers 32] [--interval-s 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import ssl
import statistics
import sys
import tempfile
import time
import urllib.parse
from typing import Any

import httpx
import numpy as np
from _common import ServeProcess, report, target

import jaxpod
from jaxpod.timeouts import wait_for

SIZE = 256  # the step's matrices: SIZE x SIZE float32
#: Steps per on-device loop: loops of tens of milliseconds, as a TPU job's loops are at
#: least; the loop's host-side bookkeeping is then not what the job's rate measures.
STEPS_PER_RUN = 100


def matmul_step(state: Any, batch: Any) -> Any:
    """A data-parallel step: each replica multiplies its rows, the gradient-like update
    is all-reduced; enough device work per step that the rate is steady."""
    ctx = jaxpod.get_replica_context()
    y = batch @ state["w"]
    update = ctx.all_reduce("MEAN", batch.T @ y) / SIZE
    w = state["w"] - 1e-6 * update
    return {"w": w}, {"loss": (y ** 2).mean(axis=1)}


async def poll(url: str, token: str, pollers: int, interval_s: float, seconds: float,
               tls: ssl.SSLContext | None = None) -> tuple[list[float], int]:
    """``pollers`` concurrent pollers of ``url`` for ``seconds``; every request's wall
    time (s) and the number of failed ones.

    Each poller is a bare HTTP/1.1 keep-alive connection (asyncio streams): the
    pollers share this machine's cores with the service and the job's workers, where a
    dashboard's browsers would not, so they should take as little of them as they can
    (httpx's client took about 4 ms of CPU per request, 13 % of a core at 32 pollers).
    With ``tls``, each connection is a TLS one (its handshake counted in its first poll).
    """
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or (443 if tls else 80)
    request = (f"GET {parsed.path} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
               f"Authorization: Bearer {token}\r\n\r\n").encode()
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def poller(index: int) -> None:
        nonlocal errors
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        # Spread the pollers over the interval, as independent browsers would be.
        due = time.monotonic() + interval_s * index / pollers
        try:
            while True:
                now = time.monotonic()
                if due >= stop_at:
                    return
                if due > now:
                    await asyncio.sleep(due - now)  # the poll schedule, not a wait on state
                started = time.perf_counter()
                try:
                    if connection is None:
                        connection = await asyncio.open_connection(host, port, ssl=tls)
                    ok = await _get(*connection, request)
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                if not ok and connection is not None:
                    connection[1].close()
                    connection = None  # the next poll connects again
                latencies.append(time.perf_counter() - started)
                errors += not ok
                due = max(due + interval_s, time.monotonic() if interval_s == 0 else due)
        finally:
            if connection is not None:
                connection[1].close()

    await asyncio.gather(*(poller(i) for i in range(pollers)))
    return latencies, errors


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
               ) -> bool:
    """Sends ``request`` and reads the whole answer; whether it was a 200 with the
    job list (a ``Content-Length`` body, as uvicorn sends a whole JSON answer)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in header_lines
                   if line.lower().startswith("content-length:")), None)
    if length is None:
        raise ValueError(f"no Content-Length in the answer: {status_line}")
    body = await reader.readexactly(length)
    return status_line.split(" ", 2)[1] == "200" and body.startswith(b'{"jobs"')


def _process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user and system, from ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads it starts later inherit it)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), cpus)


def cores_apart(service_pid: int) -> dict[str, Any]:
    """Pins the job's host workers (below ``service_pid``) to the last core, the rest of
    the service and this process to the others; what went where."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--cores apart needs 2 cores or more; run with --cores shared.")
    hosts, rest = {cpus[-1]}, set(cpus[:-1])
    pids = _descendants(service_pid)
    workers = [p for p in pids if _cmdline(p).startswith("ray::HostWorker")]
    if not workers:
        raise SystemExit("found no ray::HostWorker process below jaxpod serve "
                         f"(pid {service_pid}) to pin; run with --cores shared.")
    for pid in pids:
        with contextlib.suppress(OSError):  # ended meanwhile
            _pin(pid, hosts if pid in workers else rest)
    _pin(os.getpid(), rest)
    return {"host_worker_cpus": sorted(hosts), "service_cpus": sorted(rest),
            "host_worker_pids": workers}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_p99(service: ServeProcess, route: str) -> float | None:
    """The service's own p99 for ``route`` (ms), from its ``/metrics`` histogram: the
    upper bound of the bucket the 99th percentile falls in."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(service.http + "/metrics", timeout=30, verify=service.verify,
                     headers={"Authorization": f"Bearer {service.token}"}).text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "jaxpod_http_request_duration_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("route") == route:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    if not buckets:
        return None
    total = buckets[float("inf")]
    return next(le * 1000 for le, n in sorted(buckets.items()) if n >= 0.99 * total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s phases, 2 rounds")
    parser.add_argument("--pollers", type=int, default=32)
    parser.add_argument("--interval-s", type=float, default=1.0,
                        help="each poller's period (0: back to back)")
    parser.add_argument("--phase-s", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tls", action="store_true",
                        help="serve gRPC and HTTP over TLS (a self-signed certificate)")
    parser.add_argument("--cores", choices=("apart", "shared"), default="apart",
                        help="apart: the job's host workers on a core of their own, as "
                             "on a slice (default); shared: every process on every core")
    args = parser.parse_args()
    phase_s = args.phase_s or (3.0 if args.quick else 10.0)
    rounds = args.rounds or (2 if args.quick else 6)

    load_before = os.getloadavg()[0]
    log_path = os.path.join(tempfile.gettempdir(), f"jaxpod-bench-dashboard-{os.getpid()}.log")
    print(f"starting jaxpod serve --local (log {log_path})", file=sys.stderr, flush=True)
    service = ServeProcess(log_path, "v4-8", tls=args.tls)
    try:
        client = jaxpod.connect(service.address, token=service.token, tls_ca=service.ca)
        rng = np.random.default_rng(0)
        batches = [rng.normal(size=(SIZE, SIZE)).astype(np.float32) for _ in range(4)]
        job = client.submit(matmul_step, steps=10**9, steps_per_run=STEPS_PER_RUN,
                            accelerator_type="v4-8", dataset=batches,
                            initial_state={"w": np.eye(SIZE, dtype=np.float32)},
                            outputs={"loss": "MEAN"}, name="dashboard-bench")
        try:
            # Past allocation and compilation before anything is timed.
            started = wait_for(lambda: job.status().step >= 5 * STEPS_PER_RUN, 180, max_poll_s=0.5)
            assert started, f"the job did not get going: {job.status()}"
            placement = (cores_apart(service.process.pid) if args.cores == "apart"
                         else {})
            quiet: list[tuple[int, float]] = []
            polled: list[tuple[int, float]] = []
            latencies: list[float] = []
            errors = 0
            served: float | None = None
            pollers_cpu: list[float] = []
            service_cpu: dict[str, list[float]] = {"quiet": [], "polled": []}

            def phase(kind: str) -> None:
                nonlocal errors
                step0, t0 = job.status().step, time.monotonic()
                served0 = _process_cpu_s(service.process.pid)
                if kind == "polled":
                    cpu0 = _own_cpu_s()
                    got, failed = asyncio.run(poll(
                        service.http + "/api/v1/jobs", service.token, args.pollers,
                        args.interval_s, phase_s,
                        service.verify if isinstance(service.verify, ssl.SSLContext)
                        else None))
                    latencies.extend(got)
                    errors += failed
                    pollers_cpu.append(_own_cpu_s() - cpu0)
                else:
                    wait_for(lambda: time.monotonic() - t0 >= phase_s, phase_s + 5,
                             max_poll_s=0.5)  # the phase's length: nothing to wait on
                step1, t1 = job.status().step, time.monotonic()
                service_cpu[kind].append(_process_cpu_s(service.process.pid) - served0)
                (polled if kind == "polled" else quiet).append((step1 - step0, t1 - t0))
                print(f"{kind}: {(step1 - step0) / (t1 - t0):.1f} steps/s", file=sys.stderr,
                      flush=True)

            phase("quiet")
            for _ in range(rounds):
                phase("polled")
                phase("quiet")
            served = server_p99(service, "/api/v1/jobs")
        finally:
            job.cancel()
            client.close()
    except BaseException:
        print(f"jaxpod serve log (kept at {log_path}):\n{service.log_tail()}", flush=True)
        raise
    finally:
        service.stop()
    os.unlink(log_path)  # kept only when something failed

    def rate(phases: list[tuple[int, float]]) -> float:
        return sum(s for s, _ in phases) / sum(t for _, t in phases)

    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan")
    quiet_rate, polled_rate = rate(quiet), rate(polled)
    # Polled phase i lies between quiet phases i and i + 1.
    paired = [rate([p]) / ((rate([quiet[i]]) + rate([quiet[i + 1]])) / 2)
              for i, p in enumerate(polled)]
    polled_vs_quiet = statistics.median(paired)
    polled_s = sum(t for _, t in polled)
    quiet_s = sum(t for _, t in quiet)
    figures = {
        "tls": args.tls,
        "pollers": args.pollers, "interval_s": args.interval_s, "phase_s": phase_s,
        "rounds": rounds, "requests": len(ms), "errors": errors,
        "requests_per_s": round(len(ms) / polled_s, 1) if polled_s else 0.0,
        "p50_ms": round(statistics.median(ms), 2) if ms else None,
        "p99_ms": round(p99, 2), "max_ms": round(ms[-1], 2) if ms else None,
        "server_p99_ms_at_most": served,
        "steps_per_s_quiet": round(quiet_rate, 1),
        "steps_per_s_polled": round(polled_rate, 1),
        "polled_vs_quiet": round(polled_vs_quiet, 4),
        "polled_vs_quiet_each": [round(r, 4) for r in paired],
        "polled_vs_quiet_pooled": round(polled_rate / quiet_rate, 4),
        # Other work on the machine shows in the tails and the rates: say how busy it was.
        # The pollers run on this machine too: the CPU they took from the job's cores.
        "pollers_cpu_s_per_s": round(sum(pollers_cpu) / polled_s, 3) if polled_s else None,
        "service_cpu_s_per_s_quiet": round(sum(service_cpu["quiet"]) / quiet_s, 3),
        "service_cpu_s_per_s_polled": round(sum(service_cpu["polled"]) / polled_s, 3)
        if polled_s else None,
        "cores": args.cores, **{k: v for k, v in placement.items()
                                if k != "host_worker_pids"},
        "cpus": os.cpu_count(), "load_avg_1m": [round(load_before, 1),
                                                round(os.getloadavg()[0], 1)],
    }
    report("dashboard", figures, {
        "p99_ms": target(p99, "<", 50.0),
        "errors": target(errors, "<=", 0),
        "polled_vs_quiet": target(polled_vs_quiet, ">=", 0.95),
    })


if __name__ == "__main__":
    main()
