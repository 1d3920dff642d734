"""``jaxpod cluster``: print the resolved TPU slices and hosts as a table.

Where it looks:

* ``--slices v4-16,v4-8``: starts the simulated local TPU cluster with those slices,
  prints it, and stops it again (a quick look at what the embedded default offers);
* ``--address`` or ``$RAY_ADDRESS``: that Ray cluster, with each slice's state
  (``idle``/``busy``/``unhealthy``) and each host's free chips;
* otherwise whatever :func:`jaxpod.service.capacity.resolvers.auto` finds (GKE env vars, GCE
  metadata, a Ray connection, or this host's devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence

from jaxpod.service.capacity.resolvers import auto
from jaxpod.service.capacity.resolvers.base import ClusterInfo

_HEADERS = ("SLICE", "TYPE", "TOPOLOGY", "STATE", "WORKER", "ADDRESS", "CHIPS", "TPU FREE",
            "NODE")


def run_cluster(args: argparse.Namespace) -> int:
    """Entry point of ``jaxpod cluster``.

    Args:
      args: may carry ``slices`` (str), ``address`` (str) and ``json`` (bool); any
        of them missing counts as not given.

    Returns:
      The exit status (0).
    """
    slices = getattr(args, "slices", None)
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
    if slices:
        from jaxpod.service.capacity.local_cluster import LocalTPUCluster

        with LocalTPUCluster(slices) as cluster:
            text = _ray_report(cluster.address, as_json=bool(getattr(args, "json", False)))
    elif address:
        text = _ray_report(address, as_json=bool(getattr(args, "json", False)))
    else:
        info = auto().resolve()
        text = _to_json(info) if getattr(args, "json", False) else format_cluster(info)
    print(text)
    return 0


def _ray_report(address: str, *, as_json: bool) -> str:
    """Resolves a Ray cluster (connecting, and disconnecting if this call connected)."""
    import ray

    from jaxpod.service.capacity.resolvers.ray import RayResolver, snapshot

    connected_here = not ray.is_initialized()
    try:
        info = RayResolver(address).resolve()
        states, _ = snapshot()
    finally:
        if connected_here:
            ray.shutdown()
    if as_json:
        return _to_json(info)
    rows = [
        (s.info.name, s.info.accelerator_type, s.info.topology, s.state,
         str(h.info.worker_id), h.info.address, str(h.info.chips), f"{h.tpu_free:g}",
         (h.info.node_id or "-")[:12])
        for s in states for h in s.hosts
    ]
    return _report(info, rows)


def format_cluster(info: ClusterInfo) -> str:
    """The table for a non-Ray environment (no free-resource view there)."""
    rows = []
    for s in info.slices:
        for h in s.hosts:
            here = s.name == info.current_slice and h.worker_id == info.worker_id
            rows.append((s.name, s.accelerator_type, s.topology, "this host" if here else "-",
                         str(h.worker_id), h.address, str(h.chips), "-",
                         (h.node_id or "-")[:12]))
    return _report(info, rows)


def _report(info: ClusterInfo, rows: Sequence[tuple[str, ...]]) -> str:
    lines = [f"environment: {info.environment} ({info.source})", _table(rows)]
    hosts = sum(len(s.hosts) for s in info.slices)
    lines.append(f"{len(info.slices)} slice(s), {hosts} host(s)")
    if info.megascale is not None:
        m = info.megascale
        lines.append(f"multi-slice: slice {m.slice_id} of {m.num_slices}, coordinator "
                     f"{m.coordinator_host or '-'}:{m.port}")
    lines.extend(f"note: {n}" for n in info.notes)
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(_HEADERS)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [_HEADERS, *rows]
    )


def _to_json(info: ClusterInfo) -> str:
    return json.dumps(dataclasses.asdict(info), indent=2)
