"""``jaxpod.connect()`` and the :class:`Client`: a session with a jaxpod service.

A client opens one session, keeps it alive with heartbeats on a background thread,
and hands out :class:`~jaxpod.client.remote.RemoteStrategy` objects, each holding one
slice. Closing the client (or the process exiting) closes the session, which
releases every slice it holds.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc.experimental  # not loaded by ``import grpc``; ChannelOptions lives there

import jaxpod
from jaxpod import errors, settings
from jaxpod.client import embedded, rpc
from jaxpod.client.jobs import (
    Job,
    build_spec,
    check_state,
    fork_request,
    status_from,
    submit_spec,
)
from jaxpod.client.remote import RemoteStrategy
from jaxpod.client.stream import OpStream
from jaxpod.errors import SessionError
from jaxpod.jobs import AuditRecord, JobStatus
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import coordinator_pb2_grpc as pb_grpc
from jaxpod.proto.job_messages import from_message
from jaxpod.proto.tensors import PROTOCOL_VERSION, channel_options, parse_chunk
from jaxpod.settings import Setting

logger = logging.getLogger(__name__)

TOKEN_ENV = settings.TOKEN.name
TLS_CA_ENV = settings.TLS_CA.name


def connect(address: str | None = None, token: str | None = None, *,
            lease_s: float | None = None, tls_ca: str | bytes | bool | None = None
            ) -> Client:
    """Opens a session: :func:`jaxpod.client.connect` (the public entry point, which
    starts the embedded service early), once the SDK is loaded."""
    address = address or settings.ADDRESS.get()
    source = "jaxpod.connect(token=...)"
    service = None
    if address is None:
        service = embedded.shared()
        address, token, source = service.address, service.token, "the embedded service"
    elif token is None:
        token, source = settings.TOKEN.get(), f"${TOKEN_ENV}"
    if tls_ca is None and service is None:
        tls_ca = settings.TLS_CA.get()
    return Client(address, token, lease_s=lease_s, token_source=source,
                  tls_ca=_read_ca(tls_ca))


def _read_ca(tls_ca: str | bytes | bool | None) -> bytes | bool | None:
    if tls_ca is None or tls_ca is False:
        return None
    if isinstance(tls_ca, bytes) or tls_ca is True:
        return tls_ca
    try:
        with open(os.path.expanduser(tls_ca), "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"tls_ca={tls_ca!r} (or ${TLS_CA_ENV}): cannot read the CA "
                         f"certificate ({e.strerror}). Give the path of a PEM file, or its "
                         "bytes.") from None


class Client:
    """One session with a jaxpod service.

    Args:
      address: ``host:port``.
      token: bearer token, if the service requires one.
      lease_s: requested session lease (0 or ``None``: the service's default).
      token_source: where ``token`` came from, for the error when it is refused.
      tls_ca: the CA certificate (PEM bytes) to trust over TLS (``True``: the system's
        roots; ``None``: plain text).
    """

    def __init__(self, address: str, token: str | None = None,
                 lease_s: float | None = None, token_source: str = "token=",
                 tls_ca: bytes | bool | None = None) -> None:
        self.address = address
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        # Result streams are read on the calling thread (no hand-off per message).
        options = [*channel_options(),
                   (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
        self._channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(
            None if tls_ca is True else tls_ca), options=options) if tls_ca
            else grpc.insecure_channel(address, options=options))
        self.stub = _coordinator_stub(self._channel)
        from jaxpod.shipping import runtime_versions

        self.runtime_versions = runtime_versions()
        try:
            reply = self.call(self.stub.OpenSession, pb.OpenSessionRequest(
                client_version=jaxpod.__version__, protocol_version=PROTOCOL_VERSION,
                lease_s=lease_s or 0.0, runtime_versions=self.runtime_versions),
                what="connect", idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        except errors.AuthenticationError as e:
            self._channel.close()
            e.add_note(f"The token was taken from {token_source}." if token else
                       f"No token was given (neither token= nor ${TOKEN_ENV} is set).")
            raise
        except BaseException:
            self._channel.close()
            raise
        self.session_id = reply.session_id
        self.lease_s = reply.lease_s
        self.server_version = reply.server_version
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="jaxpod-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        #: The slices' operation streams, ended before the session closes.
        self.streams: weakref.WeakSet[OpStream] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _close_session, self.stub,
                                           self.session_id, self._metadata, self._closed,
                                           self._channel, self.streams)
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------- calls
    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def check_open(self, what: str) -> None:
        if self._closed.is_set():
            raise SessionError(f"{what}: this jaxpod client is closed; call "
                               "jaxpod.connect() again.")

    def call(self, method: Any, request: Any, *, what: str, idempotent: bool = False,
             timeout: Setting = rpc.CALL_TIMEOUT) -> Any:
        return rpc.call(method, request, what=what, metadata=self._metadata,
                        timeout=timeout, idempotent=idempotent)

    def stream(self, method: Any, request: Any, consume: Any, *, what: str) -> Any:
        return rpc.stream(method, request, consume, what=what, metadata=self._metadata,
                          timeout=rpc.CALL_TIMEOUT)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def _beat(self) -> None:
        interval = max(0.05, self.lease_s / 3)
        while not self._closed.wait(interval):
            try:
                self.stub.Heartbeat(pb.SessionRequest(session_id=self.session_id),
                                    timeout=max(1.0, interval), metadata=self._metadata)
            except grpc.RpcError as e:
                call: Any = e
                if call.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.warning("jaxpod session %s ended on the service: %s",
                                   self.session_id, call.details())
                    return
                logger.debug("heartbeat failed: %s", call.details())

    # ---------------------------------------------------------------- strategies
    def strategy(self, accelerator_type: str | None = None, num_slices: int = 1,
                 steps_per_run: int = 1, *, computation_shape: Sequence[int] | None = None,
                 num_replicas: int | None = None, timeout_s: float | None = None
                 ) -> RemoteStrategy:
        """Acquires whole slices and returns a strategy running on them.

        Args:
          accelerator_type: e.g. ``"v4-16"``; ``None`` takes the type of the cluster's
            first idle slice.
          num_slices: slices (more than one: a multi-slice replica group).
          steps_per_run: default steps per ``run_steps`` call.
          computation_shape: logical devices per replica, as
            ``DeviceAssignment.build`` takes it (``None``: one device per replica).
          num_replicas: replicas to use (``None``: as many as the slice holds).
          timeout_s: allocation time-out (default: the service's).

        Returns:
          The strategy; use it as a context manager, or ``close()`` it, to give the
          slices back.
        """
        self.check_open("strategy")
        if accelerator_type is None:
            accelerator_type = self._idle_type()
        _check_positive("num_slices", num_slices)
        _check_positive("steps_per_run", steps_per_run)
        if num_replicas is not None:
            _check_positive("num_replicas", num_replicas)
        info = self.call(self.stub.AcquireSlice, pb.AcquireSliceRequest(
            session_id=self.session_id, accelerator_type=accelerator_type,
            num_slices=num_slices, steps_per_run=steps_per_run,
            computation_shape=list(computation_shape or ()),
            num_replicas=num_replicas or 0, timeout_s=timeout_s or 0.0),
            what=f"strategy({accelerator_type!r})", timeout=rpc.ACQUIRE_TIMEOUT)
        return RemoteStrategy(self, info, steps_per_run, computation_shape=computation_shape)

    def _idle_type(self) -> str:
        slices = self.cluster()
        idle = [s for s in slices if not s["holder"]]
        if not idle:
            raise ValueError(
                "strategy(): no accelerator_type given and the cluster has no free slice "
                f"(slices: {[s['name'] for s in slices]}). Pass accelerator_type=... .")
        return str(idle[0]["accelerator_type"])

    def cluster(self) -> list[dict[str, Any]]:
        """The service's slices: name, accelerator type, hosts and holder (a digest of
        the holding session's id, never the id itself)."""
        self.check_open("cluster")
        reply = self.call(self.stub.ClusterStatus, pb.Empty(), what="cluster",
                          idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        return [{"name": s.name, "accelerator_type": s.accelerator_type,
                 "num_hosts": s.num_hosts, "holder": s.holder} for s in reply.slices]

    def teams(self) -> list[dict[str, Any]]:
        """How the teams of the service's tokens share its slices now: each team's
        weight, slices held, slices its weight entitles it to among the active teams,
        slices borrowed beyond those, and jobs queued (empty: no teams declared)."""
        self.check_open("teams")
        reply = self.call(self.stub.ClusterStatus, pb.Empty(), what="teams",
                          idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        return [{"team": t.team, "weight": t.weight, "held": t.held, "entitled": t.entitled,
                 "borrowed": t.borrowed, "queued": t.queued} for t in reply.teams]

    # --------------------------------------------------------------------- jobs
    def submit(self, step_fn: Callable[..., Any], *, steps: int,
               accelerator_type: str | Sequence[str] | None = None,
               init_fn: Callable[[], Any] | None = None,
               initial_state: Any = None, dataset: Any = None,
               dataset_fn: Callable[..., Any] | None = None, steps_per_run: int = 1,
               outputs: Mapping[str, Any] | None = None, checkpoint_every: int | None = None,
               name: str | None = None, num_slices: int = 1, max_retries_preemption: int = 10,
               max_retries_failure: int = 0, priority: int = 0,
               computation_shape: Sequence[int] | None = None,
               mesh: Mapping[str, int] | None = None, batch_sharding: Any = None,
               grow_back: bool = True, memory_checkpoint_every: int | None = None,
               min_runtime_s: float | None = None, max_runtime_s: float | None = None
               ) -> Job:
        """Submits a job: ``steps`` steps of ``step_fn`` on whole slices, run by the
        service whether or not this client stays connected.

        Args:
          step_fn: ``step_fn(state, batch) -> (state, outputs)``, run per replica as in
            ``strategy.run_steps`` (the replica context is available).
          steps: steps to run (>= 1); the input starts over when it runs out.
          accelerator_type: slice type, e.g. ``"v4-16"`` (``None``: the type of the
            cluster's first slice), or several in order of preference, e.g.
            ``("v4-16", "v4-8")``: an elastic job, which starts and resumes on the most
            preferred type free at the time, keeps its global batch and input position
            across types, and moves back up at a checkpoint once a more preferred type
            is free.
          init_fn: builds the state, run per replica (as ``strategy.run(init_fn)``).
          initial_state: the state every replica starts from (instead of ``init_fn``).
            With neither, the state is ``None``.
          dataset: re-iterable global batches (a list, not a generator), split over the
            replicas as ``experimental_distribute_dataset`` does.
          dataset_fn: ``dataset_fn(jaxpod.InputContext)``, called once per host, as
            ``distribute_datasets_from_function`` does (instead of ``dataset``). With
            neither, ``step_fn`` gets ``None`` as its batch.
          steps_per_run: steps per on-device loop.
          outputs: ``{name: reduce op}`` for entries of ``step_fn``'s outputs dict,
            reduced over replicas after every loop and recorded as metrics.
          checkpoint_every: steps between automatic checkpoints of the state and input
            position, rounded up to a loop of ``steps_per_run`` (``None``: none; a
            preempted attempt then starts over, unless a preemption notice let it
            checkpoint first).
          name: a name to show (default: the job's id).
          num_slices: slices the job runs on.
          max_retries_preemption: retries after a lost host or a preempted slice.
          max_retries_failure: retries after an exception in the job's code.
          priority: higher runs first (then submission order). When no slice of its
            type is free, the job preempts the lowest-priority running job of strictly
            lower priority: that job checkpoints at its next loop boundary, gives its
            slice up, and waits again at the head of its priority, losing no step.
          computation_shape: logical devices per replica, as ``client.strategy`` and
            ``DeviceAssignment.build`` take it (``None``: one device per replica). The
            step reaches them through ``jaxpod.get_strategy()``, e.g.
            ``jaxpod.get_strategy().experimental_split_to_logical_devices(x, [2, 1])``;
            a state left split stays split from loop to loop and in its checkpoints.
          mesh: makes a global-view job (DESIGN §8): axis names to sizes over the
            slice's chips, e.g. ``{"data": -1, "model": 2}`` (-1: the rest). ``init_fn()``
            and ``step_fn(state, batch)`` then run under ``jax.jit`` over the whole slice
            with global arrays, ``jaxpod.mesh()`` being the mesh; each state leaf keeps
            the sharding ``init_fn`` gave it; declared outputs must be scalars. See
            docs/sharded-jobs.md.
          batch_sharding: a global-view job's ``PartitionSpec`` for every batch leaf (or
            a pytree of them); default: rows over the mesh's first axis.
          grow_back: an elastic job running on a less preferred type moves up to a more
            preferred one once it is free (at a checkpoint); ``False``: it stays where
            it runs until it has to move.
          memory_checkpoint_every: steps between in-memory checkpoints, rounded up to a
            loop: each host keeps its shards of the state in its node's memory and a
            copy on a peer host's, so a job that loses a host without notice resumes
            from there, losing at most this many steps and reading no storage.
            ``None``: the service chooses, from their measured cost, for a job with
            ``checkpoint_every``; 0: none.
          min_runtime_s: seconds each attempt runs before a job of another team (or of
            higher priority) may preempt it, unless no other job can free the slice
            (``None``: the service's ``JAXPOD_JOB_MIN_RUNTIME_S``).
          max_runtime_s: seconds the job may run in all (its attempts' running time);
            then it ends ``SUCCEEDED`` early with a final checkpoint (``None``: no
            limit).

        Returns:
          The job (``job.id`` finds it again from anywhere: ``client.job(id)``).

        Raises:
          TypeError, ValueError: a bad argument (the message says what to fix).
          jaxpod.MessageTooLargeError: the shipped objects (a large in-memory dataset)
            exceed the message limit; pass a ``dataset_fn`` that loads it on the hosts.
        """
        self.check_open("submit")
        spec = build_spec(
            step_fn, steps=steps, accelerator_type=accelerator_type, init_fn=init_fn,
            initial_state=initial_state, dataset=dataset, dataset_fn=dataset_fn,
            steps_per_run=steps_per_run, outputs=outputs, checkpoint_every=checkpoint_every,
            name=name, num_slices=num_slices, max_retries_preemption=max_retries_preemption,
            max_retries_failure=max_retries_failure, priority=priority,
            computation_shape=computation_shape, mesh=mesh, batch_sharding=batch_sharding,
            grow_back=grow_back, memory_checkpoint_every=memory_checkpoint_every,
            min_runtime_s=min_runtime_s, max_runtime_s=max_runtime_s)
        return submit_spec(self, spec)

    def fork(self, job_id: str, *, step: int, steps: int | None = None,
             **overrides: Any) -> Job:
        """Starts a new job, this client's, that runs steps ``step``..``steps`` of job
        ``job_id``'s spec from that job's checkpoint of ``step`` (any it still keeps, as
        ``job.checkpoints()`` lists them; a finished job keeps its last few). The
        source is untouched; the fork resumes its state and input position there, so
        with no overrides it computes what the source computed from ``step`` on, bit
        for bit. The step is pinned until the fork has finished: a running source's
        clean-up of old checkpoints keeps it. Of a running source, fork from its newest
        checkpoint: an older one may be being deleted, and is refused.

        Args:
          job_id: the source job (one of this token's, or any for an admin).
          step: the checkpoint's step.
          steps: the fork's last step (default: the source's).
          **overrides: ``client.submit`` keywords to change: ``step_fn`` (a branch
            with another learning rate, say), ``name``, ``priority``,
            ``checkpoint_every``, ``memory_checkpoint_every``, ``max_retries_*``,
            ``min_runtime_s``, ``max_runtime_s``, ``grow_back``.

        Raises:
          TypeError, ValueError: a bad argument, a keyword a fork cannot change, a
            step the source keeps no checkpoint of (the message lists those it keeps),
            or a running source's step that may be being deleted (it names the safe one).
        """
        self.check_open("fork")
        request = fork_request(job_id, step, steps, overrides)
        # Not retried: a fork that reached the service would run twice.
        reply = self.call(self.stub.ForkJob, request, what="fork",
                          timeout=rpc.CONTROL_TIMEOUT)
        return Job(self, reply.id, reply.name or reply.id)

    def job(self, job_id: str) -> Job:
        """The job with this id, submitted by any client.

        Raises:
          jaxpod.JobNotFoundError: the service has no such job.
        """
        self.check_open("job")
        if not isinstance(job_id, str) or not job_id:
            raise TypeError(f"job: job_id must be a job's id string (as job.id or `jaxpod "
                            f"jobs` shows it). Got {job_id!r}.")
        reply = self.call(self.stub.GetJob, pb.JobRequest(job_id=job_id),
                          what=f"job({job_id!r})", idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        return Job(self, reply.status.id or job_id, reply.status.name or job_id)

    def jobs(self, state: str | None = None) -> list[JobStatus]:
        """Every job the service knows (in the order it lists them), or only those
        in ``state`` (e.g. ``"RUNNING"``, any case)."""
        self.check_open("jobs")
        wanted = check_state(state)
        reply = self.call(self.stub.ListJobs, pb.ListJobsRequest(state=wanted), what="jobs",
                          idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        return [status_from(s) for s in reply.jobs]

    def audit(self, limit: int = 100, before: int = 0) -> list[AuditRecord]:
        """The service's audit log, newest last: who submitted, cancelled or was refused
        what (``before``: only records with a smaller ``seq``, to page back). Needs an
        admin token.

        Raises:
          jaxpod.PermissionDeniedError: the token is not an admin's.
        """
        self.check_open("audit")
        reply = self.call(self.stub.ListAudit, pb.AuditRequest(limit=limit, before=before),
                          what="audit", idempotent=True, timeout=rpc.CONTROL_TIMEOUT)
        return [from_message(AuditRecord, r) for r in reply.records]

    def close(self) -> None:
        """Closes the session: every slice it holds is released (its strategies see
        the client closed and stop). Idempotent."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {self.session_id[:8]}"
        return f"Client({self.address!r}, {state})"


def _coordinator_stub(channel: grpc.Channel) -> pb_grpc.CoordinatorStub:
    """The generated stub, except that result streams hand data chunks over as views
    of the received bytes (:func:`~jaxpod.proto.tensors.parse_chunk`)."""
    stub = pb_grpc.CoordinatorStub(channel)
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    for method in service.methods:
        if method.server_streaming and method.output_type is pb.ResultChunk.DESCRIPTOR:
            request = getattr(pb, method.input_type.name)
            setattr(stub, method.name, channel.unary_stream(
                f"/{service.full_name}/{method.name}",
                request_serializer=request.SerializeToString,
                response_deserializer=parse_chunk))
    return stub


def _close_session(stub: Any, session_id: str, metadata: Any, closed: threading.Event,
                   channel: grpc.Channel, streams: weakref.WeakSet[OpStream]) -> None:
    if closed.is_set():
        return
    closed.set()
    for stream in list(streams):  # their reader threads end before the channel does
        stream.close()
    try:
        stub.CloseSession(pb.SessionRequest(session_id=session_id),
                          timeout=rpc.CONTROL_TIMEOUT.seconds(), metadata=metadata)
    except grpc.RpcError as e:  # its lease releases everything, later
        call: Any = e
        gone = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.NOT_FOUND)  # the service, or the session, is gone already
        log = logger.debug if call.code() in gone else logger.warning
        log("closing jaxpod session %s failed (%s): the service releases its slices when "
            "its lease runs out", session_id, e)
    finally:
        channel.close()


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int. Got {value!r}.")
