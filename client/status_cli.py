"""``jaxpod status``: the cluster and job summary of the dashboard, as terminal tables.

It reads a running ``jaxpod serve`` over gRPC (``--address``, default
``$JAXPOD_ADDRESS``; token from ``$JAXPOD_TOKEN``), like the job commands, and prints
the slices with their holders, then the jobs (state, progress, latest metrics,
productive share), with rich.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from jaxpod.client.jobs_cli import _add_address, _connect, _pipe_safe

#: The most recent jobs shown (``--all``: every one).
RECENT_JOBS = 20


def add_command(sub: Any) -> None:
    status = sub.add_parser("status", help="print the service's slices and jobs")
    status.add_argument("--all", action="store_true",
                        help=f"every job (default: the {RECENT_JOBS} most recent)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    _add_address(status)
    status.set_defaults(handler=_pipe_safe(run_status))


def run_status(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        slices = client.cluster()
        teams = client.teams()
        jobs = client.jobs()
    if not args.all:
        jobs = jobs[-RECENT_JOBS:]
    if args.json:
        print(json.dumps({"slices": slices, "teams": teams,
                          "jobs": [_job_row(j) for j in jobs]}))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cluster = Table(title=f"slices ({sum(not s['holder'] for s in slices)} free of "
                          f"{len(slices)})")
    for column in ("slice", "type", "hosts", "state", "holder"):
        cluster.add_column(column)
    for s in slices:
        cluster.add_row(s["name"], s["accelerator_type"], str(s["num_hosts"]),
                        "[blue]busy[/]" if s["holder"] else "[green]free[/]",
                        s["holder"] or "")
    console.print(cluster)
    if teams:  # declared in the service's tokens file
        shares = Table(title="teams (slices shared by weight)")
        for column in ("team", "weight", "held", "share", "borrowed", "queued"):
            shares.add_column(column)
        for t in teams:
            shares.add_row(t["team"], f"{t['weight']:g}", str(t["held"]),
                           f"{t['entitled']:.1f}", str(t["borrowed"]), str(t["queued"]))
        console.print(shares)
    table = Table(title=f"jobs ({len(jobs)} shown)")
    for column in ("id", "name", "type", "state", "step", "metrics", "goodput", "created"):
        table.add_column(column)
    for j in jobs:
        row = _job_row(j)
        color = {"SUCCEEDED": "green", "FAILED": "red", "RUNNING": "blue"}.get(j.state, "yellow")
        table.add_row(row["id"], row["name"], row["accelerator_type"],
                      f"[{color}]{j.state}[/]", f"{j.step}/{j.steps}",
                      " ".join(f"{k}={v:.4g}" for k, v in sorted(j.metrics.items())),
                      "" if row["productive_share"] is None
                      else f"{100 * row['productive_share']:.0f}%",
                      time.strftime("%H:%M:%S", time.localtime(j.created_at)))
    if not jobs:
        table.add_row("", "no jobs", "", "", "", "", "", "")
    console.print(table)
    return 0


def _job_row(j: Any) -> dict[str, Any]:
    share = (j.goodput or {}).get("productive_share")
    return {"id": j.id, "name": j.name, "accelerator_type": j.accelerator_type,
            "state": j.state, "step": j.step, "steps": j.steps,
            "metrics": dict(j.metrics), "productive_share": share,
            "created_at": j.created_at}
