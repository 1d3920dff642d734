"""The ``jaxpod`` command line: ``jaxpod demo``, ``jaxpod cluster``, ``jaxpod submit``, ..."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxpod.errors import JaxpodError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxpod",
        description="Run JAX step functions on TPU pod slices (TPUStrategy semantics).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small model data-parallel on a slice of the "
                                       "(embedded) service and print the loss")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--accelerator-type", default=None,
                      help="slice type to train on (default: the type of the service's "
                           "first free slice; the embedded service's is a v4-16, 2 "
                           "simulated hosts, unless $JAXPOD_LOCAL_SLICES says otherwise)")
    demo.add_argument("--address", default=None,
                      help="a running `jaxpod serve` (default $JAXPOD_ADDRESS, else start "
                           "the embedded local service)")
    demo.set_defaults(handler=_run_demo)

    cluster = sub.add_parser("cluster", help="print the resolved TPU slices and hosts")
    cluster.add_argument("--address", default=None,
                         help="Ray cluster to read (default: $RAY_ADDRESS; else resolve "
                              "this environment)")
    cluster.add_argument("--slices", default=None, metavar="TYPES",
                         help="start a simulated local TPU cluster with these slices "
                              "(e.g. v4-16,v4-8), print it, stop it")
    cluster.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cluster.set_defaults(handler=_run_cluster)

    serve = sub.add_parser("serve", help="run the coordinator service (gRPC)")
    from jaxpod.service.cli.serve import add_arguments

    add_arguments(serve)
    serve.set_defaults(handler=_run_serve)

    token = sub.add_parser("token", help="named tokens with roles for `jaxpod serve "
                                         "--tokens-file`")
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    new = token_sub.add_parser(
        "new", help="append a token to the tokens file (only its SHA-256 is kept) and "
                    "print the token, once")
    new.add_argument("name", help="who holds it; recorded as the owner of what it creates")
    new.add_argument("--role", required=True, choices=("viewer", "submitter", "admin"),
                     help="viewer: read status; submitter: also run strategies and jobs, "
                          "its own; admin: everything")
    new.add_argument("--tokens-file", required=True, metavar="TOML",
                     help="the file `jaxpod serve --tokens-file` reads (created if missing)")
    new.add_argument("--max-slices", type=int, default=None, metavar="N",
                     help="slices its strategies and jobs may hold at once (default: no cap)")
    new.add_argument("--team", default=None, metavar="TEAM",
                     help="the team its jobs count against when teams share the slices "
                          "by weight (a new team is declared with weight 1; default: the "
                          "default team)")
    new.set_defaults(handler=_run_token_new)

    deploy = sub.add_parser("deploy", help="GKE manifests for TPU node pools")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    render = deploy_sub.add_parser(
        "render", help="write a kustomize overlay (KubeRay RayCluster TPU worker group) for "
                       "a slice type from the topology table")
    # Imported here only for its arguments; light (no Ray, no gRPC).
    from jaxpod.service.cli.deploy_render import add_arguments as add_render_arguments

    add_render_arguments(render)
    render.set_defaults(handler=_run_deploy_render)

    config = sub.add_parser("config", help="print every JAXPOD_* setting, its value and "
                                           "where it came from (default or environment)")
    config.add_argument("--json", action="store_true", help="print JSON instead of a table")
    config.set_defaults(handler=_run_config)

    # submit, jobs, job, logs, cancel, profile, audit: clients of a running service
    # (--address / $JAXPOD_ADDRESS)
    from jaxpod.client.jobs_cli import add_commands

    add_commands(sub)
    from jaxpod.client.status_cli import add_command as add_status

    add_status(sub)  # jaxpod status: slices and jobs, as the dashboard shows them
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from jaxpod._demo import run_demo

    return run_demo(steps=args.steps, accelerator_type=args.accelerator_type,
                    address=args.address)


def _run_cluster(args: argparse.Namespace) -> int:
    from jaxpod.service.cli.cluster import run_cluster

    return run_cluster(args)


def _run_deploy_render(args: argparse.Namespace) -> int:
    from jaxpod.service.cli.deploy_render import run_render

    return run_render(args)


def _run_token_new(args: argparse.Namespace) -> int:
    from jaxpod.service.auth.tokens import new_token

    token = new_token(args.tokens_file, args.name, args.role, args.max_slices, args.team)
    team = f" of team {args.team!r}" if args.team else ""
    print(f"jaxpod: added {args.role} token {args.name!r}{team} to {args.tokens_file}; give "
          "it to its holder (as JAXPOD_TOKEN). It is shown only now:", file=sys.stderr)
    print(token)
    return 0


def _run_config(args: argparse.Namespace) -> int:
    import json

    from jaxpod import settings

    rows = settings.table()
    if args.json:
        print(json.dumps([dict(zip(("name", "value", "source", "part"), r, strict=True))
                          for r in rows], indent=1))
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'SETTING':<{widths[0]}}  {'VALUE':<{widths[1]}}  {'SOURCE':<{widths[2]}}  PART")
    for name, value, source, part in rows:
        print(f"{name:<{widths[0]}}  {value:<{widths[1]}}  {source:<{widths[2]}}  {part}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from jaxpod.service.cli.serve import run_serve

    return run_serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpod`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        from jaxpod import settings

        settings.check_environment()  # a typo'd or malformed JAXPOD_* variable: say so
        return int(args.handler(args))
    except BrokenPipeError:  # `jaxpod config | head`: the reader has what it wanted
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (JaxpodError, ValueError, ConnectionError) as e:
        # Bad configuration (a malformed TPU_* variable, an unknown accelerator type):
        # the message says what to fix; a traceback would bury it.
        print(f"jaxpod: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
