"""``/metrics``: the service in Prometheus' text format (``prometheus_client``).

Each service has a registry of its own (never the process-global one, so two services
in one test process do not collide), holding:

* ``jaxpod_rpc_duration_seconds``: a histogram per gRPC method of the ``Coordinator``
  service, timed by :class:`RpcTimer` (a server interceptor);
* what :class:`ServiceCollector` reads at each scrape from the same functions as the
  API: jobs by state, slices free/busy, sessions, and per unfinished job its step,
  steps per productive second, productive share, compile seconds, input-wait seconds
  and goodput seconds by category; and per host of a running job, its input wait and
  input-queue depth as the job's runner last read them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from jaxpod.service.http.backend import Backend

#: Only these calls are timed (health checks and reflection would swamp them).
TIMED_PREFIX = "/jaxpod.v1.Coordinator/"
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               5.0, 10.0, 30.0, 60.0, float("inf"))


class ServiceMetrics:
    """The service's registry, the RPC histogram the interceptor feeds and the HTTP one
    :class:`HttpTimer` feeds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_seconds = Histogram(
            "jaxpod_http_request_duration_seconds",
            "Time from an HTTP request's arrival to its answer's last byte, by route "
            "(event streams left out), method and status.", ("route", "method", "status"),
            buckets=RPC_BUCKETS, registry=self.registry)
        self.rpc_seconds = Histogram(
            "jaxpod_rpc_duration_seconds",
            "Time from a gRPC call's arrival to its answer (or its stream's end), by method "
            "and outcome.", ("method", "outcome"), buckets=RPC_BUCKETS,
            registry=self.registry)

    def watch(self, backend: Backend) -> None:
        """Adds what is read from ``backend`` at each scrape."""
        self.registry.register(ServiceCollector(backend))

    def interceptor(self) -> RpcTimer:
        return RpcTimer(self.rpc_seconds)


class HttpTimer:
    """ASGI middleware: times each HTTP request into ``histogram``, labelled by its
    route's path template (``/api/v1/jobs/{job_id}``), so job ids add no series."""

    def __init__(self, app: Any, histogram: Histogram) -> None:
        self.app = app
        self._histogram = histogram

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def timed_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            if not path.endswith("/events"):
                self._histogram.labels(path, scope["method"], str(status)).observe(
                    time.perf_counter() - started)


class RpcTimer(grpc.aio.ServerInterceptor):
    """Times every ``Coordinator`` call into ``histogram`` (labels: the method's short
    name, ``ok`` or ``error``)."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not method.startswith(TIMED_PREFIX):
            return handler
        if handler.request_streaming and handler.response_streaming:
            return handler  # the op stream lives as long as its strategy: no call time
        return _timed(handler, method[len(TIMED_PREFIX):], self._histogram)


def _timed(handler: Any, name: str, histogram: Histogram) -> Any:
    def observe(started: float, ok: bool) -> None:
        histogram.labels(name, "ok" if ok else "error").observe(time.perf_counter() - started)

    def unary(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: Any) -> Any:
            started, ok = time.perf_counter(), False
            try:
                result = await behaviour(request, context)
                ok = True
                return result
            finally:
                observe(started, ok)
        return call

    def streaming(behaviour: Callable[..., AsyncIterator[Any]]
                  ) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            started, ok = time.perf_counter(), False
            try:
                async for item in behaviour(request, context):
                    yield item
                ok = True
            finally:
                observe(started, ok)
        return call

    kinds: dict[tuple[bool, bool], tuple[str, Any, Any]] = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler, unary),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler, streaming),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler, unary)}
    attribute, make, wrap = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(wrap(getattr(handler, attribute)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ServiceCollector(Collector):
    """Reads the service at scrape time (in the scraping request's worker thread)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []  # read at scrape time: nothing to describe ahead

    def collect(self) -> Iterator[Metric]:
        backend = self._backend
        jobs = GaugeMetricFamily("jaxpod_jobs", "Jobs in the job store, by state.",
                                 labels=("state",))
        for state, count in backend.job_counts().items():
            jobs.add_metric((state,), count)
        yield jobs
        manager = backend.service.jobs
        if manager is not None:
            queued = GaugeMetricFamily("jaxpod_jobs_queued", "Jobs waiting for a slice, by "
                                       "accelerator type.", labels=("accelerator_type",))
            for kind, count in sorted(manager.queued().items()):
                queued.add_metric((kind,), count)
            yield queued
            preempted = CounterMetricFamily(
                "jaxpod_job_preemptions", "Job attempts preempted, by reason: priority (a "
                "job of higher priority took the slice; nothing lost) or slice (a notice, a "
                "lost host, a broken slice).", labels=("reason",))
            for reason in ("priority", "slice"):
                preempted.add_metric((reason,), manager.preemptions[reason])
            yield preempted

        cluster = backend.cluster()
        slices = GaugeMetricFamily("jaxpod_slices", "Slices of the cluster by state "
                                   "(free, busy, unhealthy) and accelerator type.",
                                   labels=("state", "accelerator_type"))
        counted: dict[tuple[str, str], int] = {}
        for s in cluster.slices:
            key = (s.state, s.accelerator_type)
            counted[key] = counted.get(key, 0) + 1
        for (state, kind), count in sorted(counted.items()):
            slices.add_metric((state, kind), count)
        yield slices
        yield GaugeMetricFamily("jaxpod_sessions", "Open client sessions.",
                                value=cluster.num_sessions)
        yield GaugeMetricFamily("jaxpod_cluster_ready", "1 once the cluster is up.",
                                value=1.0 if cluster.state == "ready" else 0.0)

        labels = ("job_id", "name")
        step = GaugeMetricFamily("jaxpod_job_step", "Steps done, per unfinished job.",
                                 labels=labels)
        rate = GaugeMetricFamily("jaxpod_job_steps_per_second", "Steps per wall-clock "
                                 "second over the running attempt's recent loops, per "
                                 "unfinished job.", labels=labels)
        share = GaugeMetricFamily("jaxpod_job_goodput_ratio", "Productive share of the job's "
                                  "wall time so far, per unfinished job.", labels=labels)
        compile_s = GaugeMetricFamily("jaxpod_job_compile_seconds", "Seconds the job spent "
                                      "tracing and compiling, per unfinished job.",
                                      labels=labels)
        input_wait = GaugeMetricFamily("jaxpod_job_input_wait_seconds", "Seconds the job's "
                                       "steps waited on input, per unfinished job.",
                                       labels=labels)
        categories = GaugeMetricFamily("jaxpod_job_goodput_seconds", "Seconds of the job's "
                                       "wall time by goodput category, per unfinished job.",
                                       labels=(*labels, "category"))
        host_wait = GaugeMetricFamily(
            "jaxpod_host_input_wait_seconds", "Seconds a host's steps waited for input that "
            "was not ready yet, in the job's running attempt.", labels=(*labels, "host"))
        host_depth = GaugeMetricFamily(
            "jaxpod_host_input_queue_depth", "Chunks of steps_per_run steps a host's infeed "
            "has ready, in the job's running attempt.", labels=(*labels, "host"))
        for status in backend.unfinished():
            job = (status.id, status.name)
            step.add_metric(job, status.step)
            if status.steps_per_s:
                rate.add_metric(job, status.steps_per_s)
            goodput = dict(status.goodput or {})
            if goodput:
                share.add_metric(job, goodput.get("productive_share", 0.0))
                compile_s.add_metric(job, goodput.get("compiling", 0.0))
                input_wait.add_metric(job, goodput.get("input_wait", 0.0))
            for category, seconds in sorted(goodput.items()):
                if category not in ("wall_s", "productive_share"):
                    categories.add_metric((*job, category), seconds)
            for host in backend.jobs.host_inputs(status.id):
                host_wait.add_metric((*job, str(host.host)), host.input_wait_s)
                host_depth.add_metric((*job, str(host.host)), host.input_queue_depth)
        yield from (step, rate, share, compile_s, input_wait, categories, host_wait,
                    host_depth)
