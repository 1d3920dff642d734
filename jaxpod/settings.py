"""Every ``JAXPOD_*`` setting, declared once: its name, kind, default, unit and what it
does.

A process checks its environment once where it starts (``jaxpod serve``, a host worker,
``jaxpod.connect``, each CLI command: :func:`check_environment`): a value that does not
parse is an error naming the variable, the value and what it takes, and a ``JAXPOD_``
name that no setting has is an error naming the closest one (a typo is never silently
ignored). Code reads a setting through its declaration (``OPERATION_TIMEOUT.seconds()``,
``ASYNC_WINDOW.value()``, ``STATE_DIR.get()``), never ``os.environ``; each keeps the
value it last parsed with the text it came from, so a hot path pays a dictionary lookup,
not a parse. ``jaxpod config`` prints every setting with its value and where it came
from, and ``docs/configuration.md`` is generated from these declarations
(``python -m jaxpod.settings``; a test keeps it current).

Variables a process passes to the processes it starts (a host's ``TPU_*``, a child
service's ``JAXPOD_TOKEN``) are environments of those processes, not reads.
"""

from __future__ import annotations

import difflib
import enum
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxpod.errors import JaxpodError

PREFIX = "JAXPOD_"


class Kind(enum.Enum):
    """What a setting's value is, and how its text parses."""

    SECONDS = "seconds"  # a positive number
    COUNT = "count"  # a positive int
    BYTES = "bytes"  # a positive int of bytes
    FLAG = "flag"  # 0 or 1
    TEXT = "text"  # any text (a path, an address, a token)
    CHOICE = "choice"  # one of the declared choices
    PORT = "port"  # a TCP port, 1-65535


_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


class SettingError(JaxpodError, ValueError):
    """A ``JAXPOD_*`` variable that does not parse, or that no setting has."""


@dataclass(frozen=True, eq=False)
class Setting:
    """One ``JAXPOD_*`` setting.

    Attributes:
      name: the environment variable (``JAXPOD_OPERATION_TIMEOUT_S``).
      kind: what its value is.
      default: the value when unset (``None``: no value).
      doc: what it does, one or two sentences.
      part: who reads it: ``service``, ``worker`` (each host), ``client``, ``all`` or
        ``benchmarks``.
      choices: a ``CHOICE`` setting's values.
      flag: the ``jaxpod serve`` flag that overrides it, if any.
      secret: ``jaxpod config`` shows whether it is set, never its value.
    """

    name: str
    kind: Kind
    default: Any
    doc: str
    part: str
    choices: tuple[str, ...] = ()
    flag: str = ""
    secret: bool = False
    #: The text last parsed and its value: a hot path re-reads, it does not re-parse.
    _memo: tuple[Any, Any] = field(default=(None, None), repr=False, compare=False)

    # ------------------------------------------------------------------ reading
    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value: ``environ``'s (default ``os.environ``) when set and not blank,
        else the default.

        Raises:
          SettingError: the variable's text does not parse, naming it, the text and
            what it takes.
        """
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        last_raw, last = self._memo
        if raw == last_raw:
            return last
        value = self.parse(raw)
        object.__setattr__(self, "_memo", (raw, value))  # one swap: readers see a pair
        return value

    def source(self, environ: Mapping[str, str] | None = None) -> str:
        """``environment`` when the variable is set (not blank), else ``default``."""
        env = os.environ if environ is None else environ
        return "environment" if (env.get(self.name) or "").strip() else "default"

    @property
    def env_var(self) -> str:
        """The variable's name (what errors tell users to set)."""
        return self.name

    # ------------------------------------------------------------------ kinds
    def seconds(self, environ: Mapping[str, str] | None = None) -> float:
        """A ``SECONDS`` setting's value."""
        return float(self.get(environ))

    @property
    def default_s(self) -> float:
        return float(self.default)

    def resolve(self, explicit_s: float | None) -> float:
        """``explicit_s`` when given (validated), else :meth:`seconds`: a per-call
        override beats the environment."""
        if explicit_s is None:
            return self.seconds()
        if not explicit_s > 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds. Got {explicit_s!r}.")
        return float(explicit_s)

    def value(self, explicit: int | None = None) -> Any:
        """A ``COUNT``/``BYTES`` setting's value, or ``explicit`` (validated) when given."""
        return self.get() if explicit is None else self.parse(str(explicit))

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's value.

        Raises:
          SettingError: it does not parse, naming the variable, ``raw`` and the fix.
        """
        text = raw.strip()
        kind = self.kind
        if kind is Kind.SECONDS:
            try:
                value: Any = float(text)
            except ValueError:
                value = -1.0
            if value > 0:
                return value
            raise self._error(raw, "a positive number of seconds")
        if kind in (Kind.COUNT, Kind.BYTES):
            try:
                value = int(text)
            except ValueError:
                value = 0
            if value >= 1:
                return value
            raise self._error(raw, "a positive int" + (" of bytes" if kind is Kind.BYTES
                                                       else ""))
        if kind is Kind.FLAG:
            if text.lower() in _FLAGS:
                return _FLAGS[text.lower()]
            raise self._error(raw, "0 or 1")
        if kind is Kind.CHOICE:
            if text in self.choices:
                return text
            raise self._error(raw, "one of " + ", ".join(self.choices))
        if kind is Kind.PORT:
            if text.isdecimal() and 0 < int(text) < 65536:
                return int(text)
            raise self._error(raw, "a TCP port (1-65535)")
        return raw

    def _error(self, raw: str, expected: str) -> SettingError:
        example = self.default_text() if self.default is not None else "..."
        return SettingError(
            f"{self.name}={raw!r} is not valid: expected {expected} (default "
            f"{self.default_text()}). Fix: set e.g. {self.name}={example}, or unset it. "
            f"What it sets: {self.doc}")

    def default_text(self) -> str:
        """The default as ``jaxpod config`` and the docs show it."""
        if self.default is None:
            return "unset"
        if self.kind is Kind.FLAG:
            return "1" if self.default else "0"
        if self.kind is Kind.SECONDS:
            return f"{self.default:g}"
        return str(self.default)


#: Every setting, by name (filled as they are declared below).
SETTINGS: dict[str, Setting] = {}


def _declare(name: str, kind: Kind, default: Any, doc: str, part: str, **more: Any
             ) -> Setting:
    if name in SETTINGS:
        raise ValueError(f"{name} is declared twice")
    setting = SETTINGS[name] = Setting(name, kind, default, doc, part, **more)
    return setting


def seconds(name: str, default: float, doc: str, part: str) -> Setting:
    return _declare(name, Kind.SECONDS, float(default), doc, part)


def count(name: str, default: int, doc: str, part: str, kind: Kind = Kind.COUNT) -> Setting:
    return _declare(name, kind, default, doc, part)


def _text(name: str, doc: str, part: str, **more: Any) -> Setting:
    return _declare(name, Kind.TEXT, None, doc, part, **more)


# ==================================================================== the settings
# ---------------------------------------------------------------- the client
ADDRESS = _text("JAXPOD_ADDRESS", "The service jaxpod.connect() and the CLI commands reach "
                "(host:port). Unset: jaxpod.connect() starts the embedded local service.",
                "client")
TOKEN = _text("JAXPOD_TOKEN", "The bearer token a client sends. For jaxpod serve without a "
              "tokens file: the one admin token it accepts.", "all", secret=True)
TLS_CA = _text("JAXPOD_TLS_CA", "The CA certificate (PEM file) a client trusts for a "
               "service served over TLS.", "client")
ASYNC_DISPATCH = _declare(
    "JAXPOD_ASYNC_DISPATCH", Kind.FLAG, True, "Whether a remote strategy returns handles "
    "of operations it can predict without waiting for them (0: every call waits).",
    "client")
ASYNC_WINDOW = count("JAXPOD_ASYNC_WINDOW", 64, "Operations in flight per slice before a "
                     "remote call waits for replies.", "client")
CALL_TIMEOUT = seconds("JAXPOD_CALL_TIMEOUT_S", 900, "How long a client waits for an "
                       "operation on a slice (a first call compiles; a step may be long).",
                       "client")
ACQUIRE_TIMEOUT = seconds("JAXPOD_ACQUIRE_TIMEOUT_S", 600, "How long a client waits to "
                          "acquire a slice: allocation plus starting its host workers.",
                          "client")
CONTROL_TIMEOUT = seconds("JAXPOD_CONTROL_TIMEOUT_S", 30, "How long a client waits for "
                          "session bookkeeping (open, heartbeat, close, free, status).",
                          "client")
WATCH_RECONNECT = seconds("JAXPOD_WATCH_RECONNECT_S", 120, "How long a broken job watch "
                          "is re-opened while the service is unreachable (a coordinator "
                          "restart); the window starts again with every status received.",
                          "client")
EMBEDDED_START_TIMEOUT = seconds("JAXPOD_EMBEDDED_START_TIMEOUT_S", 300, "How long "
                                 "jaxpod.connect() waits for the embedded local service "
                                 "to start.", "client")
EMBEDDED_STOP_TIMEOUT = seconds("JAXPOD_EMBEDDED_STOP_TIMEOUT_S", 60, "How long closing "
                                "the embedded local service waits for it to stop.",
                                "client")
LOCAL_SLICES = _text("JAXPOD_LOCAL_SLICES", "The slices of the embedded local service "
                     "(comma-separated accelerator types, e.g. v4-16,v4-8; default v4-16). "
                     "jaxpod serve --local reads it when --slices is not given.", "all")
LOCAL_PROVIDER = _declare(
    "JAXPOD_LOCAL_PROVIDER", Kind.CHOICE, None, "How jaxpod serve --local runs its "
    "simulated hosts: ray (a local Ray cluster) or processes (plain processes). Unset: "
    "ray for jaxpod serve, processes for the embedded service.", "all",
    choices=("ray", "processes"), flag="--provider")

# ---------------------------------------------------------------- the service
STATE_DIR = _text("JAXPOD_STATE_DIR", "Where jaxpod serve keeps its job store (default "
                  "$XDG_STATE_HOME/jaxpod, else ~/.local/state/jaxpod).", "service",
                  flag="--state-dir")
CHECKPOINT_DIR = _text("JAXPOD_CHECKPOINT_DIR", "Where the hosts write job checkpoints "
                       "and profiles, a path or URL every host reaches (default: "
                       "checkpoints/ in the state dir).", "service", flag="--checkpoint-dir")
TOKENS_FILE = _text("JAXPOD_TOKENS_FILE", "The TOML file of named tokens and their roles "
                    "jaxpod serve accepts.", "service", flag="--tokens-file")
TLS_CERT = _text("JAXPOD_TLS_CERT", "The certificate chain (PEM) jaxpod serve serves gRPC "
                 "and HTTP with.", "service", flag="--tls-cert")
TLS_KEY = _text("JAXPOD_TLS_KEY", "The private key (PEM) of JAXPOD_TLS_CERT.", "service",
                flag="--tls-key")
TUNE_MALLOC = _declare("JAXPOD_TUNE_MALLOC", Kind.FLAG, True, "Whether jaxpod serve sets "
                       "glibc malloc for large short-lived buffers (few arenas, fixed "
                       "thresholds).", "service")
SHUTDOWN_GRACE = seconds("JAXPOD_SHUTDOWN_GRACE_S", 10, "How long a stopping service "
                         "lets calls in flight finish.", "service")
SESSION_LEASE = seconds("JAXPOD_SESSION_LEASE_S", 30, "How long a session survives "
                        "without hearing from its client.", "service")
STREAM_JOIN_GRACE = seconds("JAXPOD_STREAM_JOIN_GRACE_S", 5, "How long a call that "
                            "follows an operation of the stream waits for a stream to "
                            "bring that operation.", "service")
CLUSTER_READY_TIMEOUT = seconds(
    "JAXPOD_CLUSTER_READY_TIMEOUT_S", 20, "How long a cluster status call that arrives "
    "while the service is still connecting to its cluster waits for it (under the "
    "client's JAXPOD_CONTROL_TIMEOUT_S, so the client sees the error naming this).",
    "service")
ALLOCATION_TIMEOUT = seconds("JAXPOD_ALLOCATION_TIMEOUT_S", 60, "How long an acquire "
                             "waits for whole slices of its type to be free.", "service")
HEAD_CLAIM_TIMEOUT = seconds(
    "JAXPOD_HEAD_CLAIM_TIMEOUT_S", 2, "How long a head reservation on a slice that looked "
    "idle may stay pending before the claim counts as lost to a concurrent request "
    "(and is retried elsewhere).", "service")
RELEASE_TIMEOUT = seconds("JAXPOD_RELEASE_TIMEOUT_S", 10, "How long releasing a slice "
                          "waits for its hosts to show their TPUs free again.", "service")
WARM_RESET_TIMEOUT = seconds("JAXPOD_WARM_RESET_TIMEOUT_S", 30, "How long a released "
                             "slice's workers may take to free what its holder left "
                             "there.", "service")
ORPHAN_SWEEP_TIMEOUT = seconds("JAXPOD_ORPHAN_SWEEP_TIMEOUT_S", 10, "How long the sweep of "
                               "a dead coordinator's objects waits for Ray to show them "
                               "gone.", "service")
GCE_METADATA_TIMEOUT = seconds("JAXPOD_GCE_METADATA_TIMEOUT_S", 5, "How long a request to "
                               "the GCE metadata server may take.", "all")
LOCAL_CLUSTER_START_TIMEOUT = seconds("JAXPOD_LOCAL_CLUSTER_START_TIMEOUT_S", 180, "How "
                                      "long the simulated local Ray cluster may take to "
                                      "start.", "service")
LOCAL_CLUSTER_STOP_TIMEOUT = seconds("JAXPOD_LOCAL_CLUSTER_STOP_TIMEOUT_S", 60, "How long "
                                     "the simulated local Ray cluster may take to stop.",
                                     "service")
WORKER_START_TIMEOUT = seconds("JAXPOD_WORKER_START_TIMEOUT_S", 120, "How long a slice's "
                               "host workers may take to start and join their "
                               "jax.distributed group.", "service")
OPERATION_TIMEOUT = seconds("JAXPOD_OPERATION_TIMEOUT_S", 600, "How long one operation "
                            "on a slice may take on its hosts before the slice is reset "
                            "(a host stuck in a collective the others never entered).",
                            "service")
HOST_STACKS_TIMEOUT = seconds("JAXPOD_HOST_STACKS_TIMEOUT_S", 10, "How long reading every "
                              "host's Python stacks may take (`jaxpod job stacks`, a hung "
                              "loop's report); hosts that do not answer in time are named.",
                              "service")
WORKER_STOP_TIMEOUT = seconds("JAXPOD_WORKER_STOP_TIMEOUT_S", 20, "How long a slice's "
                              "host workers may take to leave their group before they "
                              "are killed.", "service")
PIPELINE_DEPTH = count("JAXPOD_PIPELINE_DEPTH", 8, "Operations sent to a slice's hosts "
                       "ahead of their replies (1: none ahead of another).", "service")
RESULT_BLOCK_BYTES = count("JAXPOD_RESULT_BLOCK_BYTES", 4 * 1024 * 1024, "The most bytes "
                           "of a large result (gather, local results, fetch) fetched from "
                           "the hosts in one operation: the coordinator holds two blocks.",
                           "service", Kind.BYTES)
JOB_ACQUIRE_TRY = seconds("JAXPOD_JOB_ACQUIRE_TRY_S", 10, "How long one try of a job to "
                          "acquire a slice waits before the job looks whether it was "
                          "cancelled.", "service")
JOB_ALLOCATION_TIMEOUT = seconds("JAXPOD_JOB_ALLOCATION_TIMEOUT_S", 600, "How long a job "
                                 "tries to acquire a slice before it goes to RETRYING "
                                 "saying so.", "service")
JOB_ELASTIC_WAIT = seconds("JAXPOD_JOB_ELASTIC_WAIT_S", 10, "How long an elastic job "
                           "(several accelerator types) that lost its slice waits for a "
                           "slice of the type it ran on before it queues for any type it "
                           "accepts.", "service")
JOB_DISPATCH_RECHECK = seconds("JAXPOD_JOB_DISPATCH_RECHECK_S", 1, "How often, at least, "
                               "the job dispatcher looks for free slices (capacity can "
                               "appear outside the service: a node joining).", "service")
JOB_SHARE_HALF_LIFE = seconds("JAXPOD_JOB_SHARE_HALF_LIFE_S", 3600, "The half-life of "
                              "the slice-seconds teams are shared by: what a team held "
                              "this long ago counts half.", "service")
JOB_MIN_RUNTIME = seconds("JAXPOD_JOB_MIN_RUNTIME_S", 300, "How long a started job runs "
                          "before it may be preempted, unless no other job can free the "
                          "slice (a job's min_runtime_s overrides it).", "service")
JOB_STOP_TIMEOUT = seconds("JAXPOD_JOB_STOP_TIMEOUT_S", 30, "How long a stopping service "
                           "waits for running jobs to reach a loop boundary and "
                           "checkpoint.", "service")
JOB_RETRY_BACKOFF = seconds("JAXPOD_JOB_RETRY_BACKOFF_S", 0.5, "The first wait before a "
                            "preempted job's next attempt; it doubles with every "
                            "preemption, up to JAXPOD_JOB_RETRY_BACKOFF_MAX_S.", "service")
JOB_RETRY_BACKOFF_MAX = seconds("JAXPOD_JOB_RETRY_BACKOFF_MAX_S", 60, "The longest wait "
                                "before a preempted job's next attempt.", "service")
JOB_RATE_WINDOW = seconds("JAXPOD_JOB_RATE_WINDOW_S", 10, "The span of recent loops a "
                          "running job's step rate is measured over.", "service")
JOB_HOST_POLL = seconds("JAXPOD_JOB_HOST_POLL_S", 0.5, "How often, at most, a running "
                        "job's hosts are asked (between loops) for what the job printed, "
                        "preemption notices and their input figures.", "service")
JOB_HANG_TIMEOUT = seconds("JAXPOD_JOB_HANG_TIMEOUT_S", 300, "How much longer than the "
                           "slowest loop of its length so far a job's loop may run before it "
                           "counts as hung: every host's Python stack goes to the job's logs "
                           "and the job restarts from its newest checkpoint. A loop of a "
                           "length not run yet (it compiles) has JAXPOD_OPERATION_TIMEOUT_S.",
                           "service")
STORAGE_READ_TIMEOUT = seconds("JAXPOD_STORAGE_READ_TIMEOUT_S", 300, "How long one read of a "
                               "job's stored state (an array opened, a block of one) may "
                               "take while the service streams the job's result.", "service")
JOB_CHECKPOINTS_KEPT = count("JAXPOD_JOB_CHECKPOINTS_KEPT", 2, "Committed checkpoints kept "
                             "per job (the hosts remove older ones as they commit).",
                             "service")
JOB_PROFILE_WAIT = seconds("JAXPOD_JOB_PROFILE_WAIT_S", 120, "How long a profile request "
                           "waits beyond its seconds for the job's loop boundaries.",
                           "service")
JOB_WATCH_RECHECK = seconds("JAXPOD_JOB_WATCH_RECHECK_S", 5, "How often, at least, a job "
                            "watch re-reads its job (a change made by another process on "
                            "the same state dir has no event).", "service")
JOB_CANCEL_WAIT = seconds("JAXPOD_JOB_CANCEL_WAIT_S", 10, "How long cancelling a running "
                          "job waits for it to stop at its next loop boundary before "
                          "answering with the state it is in.", "service")
RETAIN_DAYS = count("JAXPOD_RETAIN_DAYS", 30, "Days a finished job is kept whole (jaxpod "
                    "serve --retain-days); then retention cuts it to its row, a few points "
                    "of each metric and how it ended, and deletes its checkpoints, unless "
                    "pinned.", "service")
RETAIN_JOBS = count("JAXPOD_RETAIN_JOBS", 1000, "The newest finished jobs kept whole "
                    "whatever their age (jaxpod serve --retain-jobs); older ones are "
                    "pruned as by JAXPOD_RETAIN_DAYS.", "service")
RETAIN_METRIC_POINTS = count("JAXPOD_RETAIN_METRIC_POINTS", 32, "Points of each metric a "
                             "pruned job keeps (evenly spaced steps, the last included).",
                             "service")
AUDIT_RETAIN_DAYS = count("JAXPOD_AUDIT_RETAIN_DAYS", 365, "Days audit records are kept "
                          "(besides the newest 100,000 at most).", "service")
RETENTION_EVERY = seconds("JAXPOD_RETENTION_EVERY_S", 600, "How often the service prunes "
                          "finished jobs past retention, trims the audit log and gives "
                          "freed database pages back.", "service")
SERVICE_LOG_MAX_BYTES = count("JAXPOD_SERVICE_LOG_MAX_BYTES", 100 * 2**20, "The size at "
                              "which jaxpod serve --log-file starts a new file (keeping "
                              "JAXPOD_SERVICE_LOG_BACKUPS old ones).", "service",
                              kind=Kind.BYTES)
SERVICE_LOG_BACKUPS = count("JAXPOD_SERVICE_LOG_BACKUPS", 5, "Old files of jaxpod serve "
                            "--log-file kept (FILE.1 ... FILE.N).", "service")
HTTP_CACHE = seconds("JAXPOD_HTTP_CACHE_S", 0.25, "How old a job list or cluster answer "
                     "of the HTTP API may be when concurrent requests share it.", "service")
HTTP_EVENTS_INTERVAL = seconds("JAXPOD_HTTP_EVENTS_INTERVAL_S", 0.2, "An HTTP event "
                               "stream sends at most one status (the latest) per this "
                               "many seconds.", "service")
HTTP_START_TIMEOUT = seconds("JAXPOD_HTTP_START_TIMEOUT_S", 30, "How long the HTTP server "
                             "may take to start listening.", "service")

# ---------------------------------------------------------------- each host
COORDINATOR_PORT = _declare("JAXPOD_COORDINATOR_PORT", Kind.PORT, None, "Pins host 0's "
                            "jax.distributed coordinator port (deploy/ sets it on every "
                            "TPU pod). Unset: a free port.", "worker")
CHANNEL_HANDSHAKE_TIMEOUT = seconds("JAXPOD_CHANNEL_HANDSHAKE_TIMEOUT_S", 10, "How long a "
                                    "peer connecting to an operation channel has to "
                                    "answer the key challenge.", "worker")
CHANNEL_LEND = _declare("JAXPOD_CHANNEL_LEND", Kind.FLAG, True, "Whether a worker on the "
                        "coordinator's machine lends large reply buffers, read in place "
                        "(0: every reply travels through the channel's socket).", "all")
FUNCTION_CACHE_BYTES = count("JAXPOD_FUNCTION_CACHE_BYTES", 256 * 2**20, "The bytes of "
                             "shipped functions a host keeps (least recently used "
                             "evicted first).", "worker", Kind.BYTES)
INFEED_PREFETCH_DEPTH = count("JAXPOD_INFEED_PREFETCH_DEPTH", 2, "Chunks of steps a "
                              "host's infeed keeps placed on its devices ahead of use.",
                              "worker")
INFEED_LOOKAHEAD_STEPS = count("JAXPOD_INFEED_LOOKAHEAD_STEPS", 8, "Steps a host's infeed "
                               "reads ahead into host memory, beyond those placed.",
                               "worker")
INFEED_CLOSE_TIMEOUT = seconds("JAXPOD_INFEED_CLOSE_TIMEOUT_S", 5, "How long closing an "
                               "infeed waits for its thread (which may be in user code).",
                               "worker")
CHECKPOINT_PEER_TIMEOUT = seconds("JAXPOD_CHECKPOINT_PEER_TIMEOUT_S", 300, "How long a "
                                  "host's checkpoint thread waits for the other hosts' "
                                  "input positions.", "worker")
MEMORY_CHECKPOINT_DIR = _text(
    "JAXPOD_MEMORY_CHECKPOINT_DIR", "Where each host keeps its jobs' in-memory checkpoints "
    "(its own shards and its peer's copy): a folder in the node's memory that outlives the "
    "worker process. Default: /dev/shm/jaxpod-memory, else jaxpod-memory in the temporary "
    "folder.", "worker")
COMPILATION_CACHE_DIR = _text(
    "JAXPOD_COMPILATION_CACHE_DIR", "Where hosts keep JAX's persistent compilation cache, "
    "so a restarted attempt and later jobs of the same code load their programs instead "
    "of compiling them: a path or gs:// URL every host of a slice reaches (the first "
    "host writes, all read; simulated hosts each write their own). Default: "
    "compilation-cache/ in JAXPOD_CHECKPOINT_DIR when the hosts have it, else "
    "~/.cache/jaxpod/compilation-cache (one machine's: enough for single-host and "
    "simulated slices). off: no cache.", "worker")
COMPILATION_CACHE_MIN_COMPILE = seconds(
    "JAXPOD_COMPILATION_CACHE_MIN_COMPILE_S", 1.0, "Programs that compile faster than "
    "this are not written to the compilation cache.", "worker")
PREEMPTION_GRACE = seconds("JAXPOD_PREEMPTION_GRACE_S", 30, "How long a worker keeps "
                           "running after SIGTERM (a preemption notice) before it exits.",
                           "worker")


# ---------------------------------------------------------------- the benchmarks
BENCH_SCRIPT_TIMEOUT = seconds("JAXPOD_BENCH_SCRIPT_TIMEOUT_S", 3600, "How long "
                               "benchmarks/run_all.py lets one benchmark script run.",
                               "benchmarks")


# ==================================================================== checking
def unknown_names(environ: Mapping[str, str]) -> list[str]:
    """The ``JAXPOD_*`` names in ``environ`` that no setting has."""
    return sorted(n for n in environ if n.startswith(PREFIX) and n not in SETTINGS)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Checks every ``JAXPOD_*`` variable of ``environ`` (default ``os.environ``): each
    parses, and each names a setting.

    Raises:
      SettingError: the first problem, saying what to fix (a typo names the closest
        setting).
    """
    env = os.environ if environ is None else environ
    for name in unknown_names(env):
        close = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.75)
        hint = (f" Did you mean {close[0]}?" if close else
                " `jaxpod config` lists every setting.")
        raise SettingError(f"{name} is set, but jaxpod has no setting of that name, so "
                           f"it would be ignored.{hint} Fix the name, or unset it.")
    for setting in SETTINGS.values():
        setting.get(env)


_checked = threading.Lock()
_checked_once: list[bool] = [False]


def check_once() -> None:
    """:func:`check_environment` of ``os.environ``, the first time a process calls it
    (library entry points: ``jaxpod.connect``, a host worker's start)."""
    with _checked:
        if _checked_once[0]:
            return
        check_environment()
        _checked_once[0] = True


def table(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """Every setting's ``(name, value, source, part)``, as ``jaxpod config`` prints
    them (a secret's value shown as ``(set)``)."""
    rows = []
    for setting in sorted(SETTINGS.values(), key=lambda s: s.name):
        source = setting.source(environ)
        value = setting.get(environ)
        if setting.secret and value is not None:
            text = "(set)"
        elif value is None:
            text = "(unset)"
        elif setting.kind is Kind.FLAG:
            text = "1" if value else "0"
        elif setting.kind is Kind.SECONDS:
            text = f"{value:g}"
        else:
            text = str(value)
        rows.append((setting.name, text, source, setting.part))
    return rows


# ==================================================================== the page
def reference() -> str:
    """``docs/configuration.md``: every setting, grouped by who reads it."""
    parts = (("client", "The client (`jaxpod.connect`, the CLI commands)"),
             ("service", "The service (`jaxpod serve`)"),
             ("worker", "Each host worker"),
             ("all", "Several parts"),
             ("benchmarks", "The benchmarks (`benchmarks/`)"))
    lines = ["# Configuration", "",
             "<!-- Generated by `python -m jaxpod.settings` from jaxpod/settings.py: do not "
             "edit. -->", "",
             "Every setting is an environment variable `JAXPOD_*`, declared once in "
             "`jaxpod/settings.py`. A process checks its environment where it starts: a "
             "value that does not parse, or a `JAXPOD_` name no setting has (a typo), is "
             "an error that says what to fix. `jaxpod config` prints every setting with "
             "its value here and where it came from (default or environment); the "
             "`jaxpod serve` flags named below override their variable.", ""]
    for part, title in parts:
        settings = sorted((s for s in SETTINGS.values() if s.part == part),
                          key=lambda s: s.name)
        lines += [f"## {title}", "", "| Setting | Kind | Default | What it does |",
                  "| --- | --- | --- | --- |"]
        for s in settings:
            kind = s.kind.value + (f" ({', '.join(s.choices)})" if s.choices else "")
            doc = s.doc + (f" Flag: `jaxpod serve {s.flag}`." if s.flag else "")
            lines.append(f"| `{s.name}` | {kind} | {s.default_text()} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def _write_reference() -> None:  # pragma: no cover - a maintainer's command
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    path.write_text(reference())
    print(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    _write_reference()
