"""``jaxpod serve``: its arguments and entry point (light to import: no gRPC, no Ray)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxpod import settings

if TYPE_CHECKING:
    from jaxpod.service.auth.tokens import TokenBook

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_HTTP_PORT = 8080
TOKEN_ENV = settings.TOKEN.name
TOKENS_FILE_ENV = settings.TOKENS_FILE.name
STATE_DIR_ENV = settings.STATE_DIR.name


#: Where job checkpoints go when --checkpoint-dir is not given.
CHECKPOINT_DIR_ENV = settings.CHECKPOINT_DIR.name
TLS_CERT_ENV, TLS_KEY_ENV = settings.TLS_CERT.name, settings.TLS_KEY.name
#: How ``--local`` runs the simulated hosts (``--provider``).
PROVIDER_ENV = settings.LOCAL_PROVIDER.name
PROVIDERS = ("ray", "processes")


def default_state_dir() -> str:
    """``$JAXPOD_STATE_DIR``, else ``~/.local/state/jaxpod`` (``$XDG_STATE_HOME`` if set)."""
    explicit = settings.STATE_DIR.get()
    if explicit:
        return explicit
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    return os.path.join(base, "jaxpod")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as in ``host:port``; IPv6 in brackets or not) only reaches this
    machine: ``localhost``, 127.0.0.0/8 or ``::1``. Names other than ``localhost``, the
    empty host and wildcard addresses (``0.0.0.0``, ``::``) are not."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def network_host(address: str) -> str | None:
    """The host of a listen ``address`` that others on the network can reach; ``None``
    for a loopback host or a ``unix:`` socket."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return None if is_loopback(host) else host


def check_listen_address(address: str, token: str | None) -> None:
    """Refuses to serve beyond loopback without a token.

    Anyone who can reach the service can run code on its cluster (step functions are
    pickled Python), so without ``$JAXPOD_TOKEN`` or a tokens file it may listen only on
    127.0.0.0/8, ``::1`` or ``localhost`` (or a ``unix:`` socket).

    Args:
      address: ``host:port`` to listen on.
      token: a token the service will require (or the tokens file's path), if any.

    Raises:
      ValueError: ``address`` is not a loopback one and there is no token; the message
        says what was received and how to fix it.
    """
    host = network_host(address)
    if token or host is None:
        return
    raise ValueError(
        f"jaxpod serve: refusing to listen on {address!r} without a token. The host "
        f"{host!r} is not a loopback address (expected 127.0.0.0/8, ::1 or localhost "
        f"when {TOKEN_ENV} is unset), and anyone who can reach the service can run code "
        f"on its cluster. Fix: set {TOKEN_ENV} to a secret (e.g. "
        f"{TOKEN_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(16))')) "
        f"and give clients the same token (jaxpod.connect(token=...) or {TOKEN_ENV}), "
        f"or listen on 127.0.0.1.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=None,
                        help="port on 127.0.0.1 (default 50051; 0 picks a free one)")
    parser.add_argument("--address", default=None,
                        help=f"host:port to listen on (default {DEFAULT_ADDRESS}); a "
                             f"non-loopback host is refused unless ${TOKEN_ENV} is set")
    parser.add_argument("--local", action="store_true",
                        help="start the simulated local TPU cluster instead of joining "
                             "$RAY_ADDRESS")
    parser.add_argument("--slices", default=None, metavar="TYPES",
                        help="with --local: the simulated slices (default v4-16)")
    parser.add_argument("--provider", default=None, choices=PROVIDERS,
                        help="with --local: how the simulated hosts run: 'ray' nodes of a "
                             "local Ray cluster, or plain 'processes' (no Ray: starts "
                             f"in about a second) (default ${PROVIDER_ENV}, else ray)")
    parser.add_argument("--prewarm", nargs="?", const="", default=None, metavar="TYPE",
                        help="with --local: start the workers of one slice of TYPE (default "
                             "the first of --slices) as the service starts, so that the "
                             "first acquire of it finds them ready")
    parser.add_argument("--lease", type=float, default=None, metavar="SECONDS",
                        help="default session lease (default $JAXPOD_SESSION_LEASE_S or 30)")
    parser.add_argument("--stop-on-stdin-eof", action="store_true",
                        help="also stop when stdin closes (for a parent process that "
                             "runs this service as its child)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="where jobs are kept (jobs.sqlite) (default "
                             f"${STATE_DIR_ENV}, else ~/.local/state/jaxpod)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="URL",
                        help="where the hosts write job checkpoints, one folder per job: a "
                             "path or URL every host reaches (gs://bucket/path on GKE) "
                             f"(default ${CHECKPOINT_DIR_ENV}, else STATE_DIR/checkpoints)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, metavar="PORT",
                        help="the HTTP API, /metrics and status page, on the gRPC host "
                             f"(default {DEFAULT_HTTP_PORT}; 0 picks a free one; -1: none)")
    parser.add_argument("--tokens-file", default=None, metavar="TOML",
                        help=f"named tokens with roles (${TOKENS_FILE_ENV}; `jaxpod token "
                             f"new` writes them); without it, ${TOKEN_ENV} is one admin "
                             "token")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="serve gRPC and HTTP over TLS with this certificate chain "
                             f"(default ${TLS_CERT_ENV}); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help=f"the certificate's private key (default ${TLS_KEY_ENV})")
    parser.add_argument("--retain-days", type=float, default=None, metavar="D",
                        help="finished jobs older than D days are pruned to a summary and "
                             "their checkpoints deleted, unless pinned (default "
                             f"${settings.RETAIN_DAYS.name}, "
                             f"{settings.RETAIN_DAYS.default_text()})")
    parser.add_argument("--retain-jobs", type=int, default=None, metavar="N",
                        help="the newest N finished jobs are kept whole whatever their age "
                             f"(default ${settings.RETAIN_JOBS.name}, "
                             f"{settings.RETAIN_JOBS.default_text()})")
    parser.add_argument("--log-file", default=None, metavar="PATH",
                        help="also write the service's log to PATH, starting a new file at "
                             f"${settings.SERVICE_LOG_MAX_BYTES.name} bytes and keeping "
                             f"${settings.SERVICE_LOG_BACKUPS.name} old ones (stderr "
                             "stays as it is: under Kubernetes its log rotates there)")
    parser.add_argument("--platform", default="cpu", choices=("cpu", "tpu"),
                        help="what the host workers run JAX on (default cpu: simulated)")


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``jaxpod serve``."""
    from jaxpod.service.cli.malloc import tune_malloc

    tuned = tune_malloc()  # first: before gRPC and Ray start their threads
    log_format = "%(asctime)s %(name)s %(levelname)s: %(message)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=log_format)
    if args.log_file:
        add_log_file(args.log_file, log_format)
    # orbax logs every read at INFO, and warns that a state item read alone has no
    # step metadata beside it: noise in a service log.
    logging.getLogger("absl").setLevel(logging.ERROR)
    address = args.address or DEFAULT_ADDRESS
    if args.port is not None:
        address = f"{address.rsplit(':', 1)[0]}:{args.port}"
    if not -1 <= args.http_port <= 65535:
        raise ValueError(f"--http-port must be a port (0 picks a free one; -1 turns HTTP "
                         f"off); got {args.http_port}.")
    if (args.slices or args.provider) and not args.local:
        raise ValueError("--slices and --provider need --local (they describe the "
                         "simulated cluster).")
    if args.prewarm is not None and not args.local:
        raise ValueError("--prewarm needs --local: it starts a slice of the simulated "
                         "cluster.")
    if args.local:
        from jaxpod.service.capacity.local_cluster import DEFAULT_SLICES

        args.slices = args.slices or DEFAULT_SLICES
    args.provider = args.provider or settings.LOCAL_PROVIDER.get() or "ray"
    if args.provider not in PROVIDERS:
        raise ValueError(f"${PROVIDER_ENV}={args.provider!r} is not a provider; expected "
                         f"one of {', '.join(PROVIDERS)}.")
    logging.getLogger(__name__).debug("malloc tuned for large buffers: %s", tuned)
    tokens_file = args.tokens_file or settings.TOKENS_FILE.get()
    tokens = token_book(tokens_file, settings.TOKEN.get())
    check_listen_address(address, tokens_file or settings.TOKEN.get())
    tls = tls_files(args.tls_cert or settings.TLS_CERT.get(),
                    args.tls_key or settings.TLS_KEY.get())
    if tls is None and network_host(address) is not None:
        logging.getLogger(__name__).warning(
            "jaxpod serve: listening on %s without TLS: the bearer token and every step "
            "function travel in clear text to anyone on the network path. Give "
            "--tls-cert and --tls-key (or $%s and $%s).", address, TLS_CERT_ENV, TLS_KEY_ENV)
    cluster: Any = None
    ahead: Any = None
    if args.prewarm is not None:
        from jaxpod.service.capacity.process_hosts import prewarm_type, start_ahead

        args.prewarm = prewarm_type(args.slices, args.prewarm)
        if args.provider == "processes":  # first: they import JAX while this imports
            ahead = start_ahead(args.slices, args.prewarm, args.platform)
    if args.local and args.provider == "ray":  # first: hosts start while this imports
        from jaxpod.service.capacity.local_cluster import LocalTPUCluster

        cluster = LocalTPUCluster(args.slices).launch()
    try:
        return _serve(args, address, tokens, cluster, tls, ahead)
    finally:
        if cluster is not None:
            cluster.stop()


def add_log_file(path: str, log_format: str) -> None:
    """The service's log also goes to ``path``, rotated by size (a service that runs
    for months must not fill its disk with its log)."""
    from logging.handlers import RotatingFileHandler

    handler = RotatingFileHandler(os.path.expanduser(path),
                                  maxBytes=int(settings.SERVICE_LOG_MAX_BYTES.value()),
                                  backupCount=int(settings.SERVICE_LOG_BACKUPS.value()))
    handler.setFormatter(logging.Formatter(log_format))
    logging.getLogger().addHandler(handler)


def tls_files(cert: str | None, key: str | None) -> Any:
    """The ``TlsFiles`` of ``--tls-cert``/``--tls-key`` (``None`` without either).

    Raises:
      ValueError: only one was given, or a file cannot be read; the message says which.
    """
    if not cert and not key:
        return None
    if not cert or not key:
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise ValueError(f"jaxpod serve: {given} was given without {missing}; TLS needs "
                         "both the certificate chain and its private key (PEM files).")
    from pathlib import Path

    from jaxpod.service.api.server import TlsFiles

    files = TlsFiles(Path(cert).expanduser(), Path(key).expanduser())
    for flag, path in (("--tls-cert", files.cert), ("--tls-key", files.key)):
        if not os.access(path, os.R_OK):
            raise ValueError(f"jaxpod serve: {flag} {str(path)!r} is not a readable file.")
    return files


def token_book(tokens_file: str | None, token: str | None) -> TokenBook | None:
    """The service's :class:`~jaxpod.service.auth.tokens.TokenBook`: the tokens file's, else
    ``token`` as one admin, else ``None`` (open, loopback only).

    Raises:
      ValueError: the tokens file cannot be read or is wrong (the message says where).
    """
    from jaxpod.service.auth.tokens import TokenBook

    if tokens_file:
        book = TokenBook.load(tokens_file)
        logging.getLogger(__name__).info("jaxpod serve: tokens %s from %s",
                                         ", ".join(book.names), tokens_file)
        return book
    return TokenBook.single(token) if token else None


def _serve(args: argparse.Namespace, address: str, tokens: TokenBook | None, cluster: Any,
           tls: Any, ahead: Any) -> int:
    from jaxpod.service.api.server import LISTENING
    from jaxpod.service.cli.serving import serve

    def make_slices() -> Any:
        slices = cluster_slices()
        if args.prewarm:
            slices.prewarm(args.prewarm)
        return slices

    def cluster_slices() -> Any:
        if args.local and args.provider == "processes":
            from jaxpod.service.capacity.process_slices import LocalProcessSlices

            return LocalProcessSlices(args.slices, ahead=ahead)
        from jaxpod.service.capacity.pools import RaySlices

        if cluster is not None:
            cluster.wait_ready()
            cluster.connect()  # a cluster of our own: no dead coordinator left anything
            return RaySlices(platform=args.platform)
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise ConnectionError("jaxpod serve: set RAY_ADDRESS to the Ray cluster to "
                                  "join, or pass --local for the simulated cluster.")
        from jaxpod.service.capacity.resolvers.ray import connect

        connect(address)
        _sweep_orphans()
        return RaySlices(platform=args.platform)

    def listening(where: str, http: str | None = None) -> None:
        announced = {"address": where, **({"http": http} if http else {}), "pid": os.getpid()}
        print(f"{LISTENING} {json.dumps(announced)}", flush=True)

    from pathlib import Path

    state_dir = Path(args.state_dir or default_state_dir()).expanduser()
    checkpoint_dir = args.checkpoint_dir or settings.CHECKPOINT_DIR.get()
    if args.platform == "tpu" and (checkpoint_dir is None or "://" not in checkpoint_dir):
        logging.getLogger(__name__).warning(
            "jobs' checkpoints go to %s: every TPU host must reach that path (a shared "
            "filesystem), or a job resumes from nothing after a lost host. Give "
            "--checkpoint-dir gs://BUCKET/PATH (or $%s).",
            checkpoint_dir or state_dir / "checkpoints", CHECKPOINT_DIR_ENV)
    from jaxpod.service.jobs.retention import RetentionPolicy

    retention = RetentionPolicy.from_settings(args.retain_days, args.retain_jobs)
    try:
        asyncio.run(serve(address, make_slices, tokens, args.lease, listening,
                          args.stop_on_stdin_eof, state_dir=state_dir,
                          http_port=None if args.http_port < 0 else args.http_port,
                          checkpoint_dir=checkpoint_dir, tls=tls, retention=retention,
                          provider_kind=("processes" if args.local and
                                         args.provider == "processes" else "ray")))
    finally:
        ray = sys.modules.get("ray")  # not imported by a service without Ray
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    return 0


def _sweep_orphans() -> None:
    """Releases what dead coordinators left on the cluster, before any slice is handed
    out. A failure is logged, not raised: the sweep is a backstop (Ray frees a dead
    driver's objects itself), and the service is still of use without it."""
    from jaxpod.service.capacity.orphans import sweep_orphans

    try:
        sweep_orphans()
    except Exception as e:
        logging.getLogger(__name__).warning(
            "jaxpod serve: the sweep for a dead coordinator's actors and placement groups "
            "failed (%s: %s); Ray still frees a dead driver's own objects. Serving anyway.",
            type(e).__name__, e)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpod serve")
    add_arguments(parser)
    return run_serve(parser.parse_args(argv))
