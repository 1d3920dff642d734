"""What a slice provider is asked for, and what it reports of its cluster: plain types,
so capacity never sees the wire format (the gRPC edge converts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SliceRequest:
    """Whole slices of one accelerator type, and how their replica group is set up.

    Attributes:
      accelerator_type: e.g. ``v4-16`` (lower case; ``""``: the cluster's first type).
      num_slices: slices held together (multislice).
      steps_per_run: steps per ``run_steps`` loop unless a call says otherwise.
      computation_shape: logical devices per replica, as ``DeviceAssignment.build``
        takes them (empty: one device each).
      num_replicas: replicas to use (0: every replica the slices have).
      timeout_s: how long to wait for free slices (0: ``JAXPOD_ALLOCATION_TIMEOUT_S``).
    """

    accelerator_type: str
    num_slices: int = 1
    steps_per_run: int = 1
    computation_shape: tuple[int, ...] = ()
    num_replicas: int = 0
    timeout_s: float = 0.0

    def waiting_at_most(self, timeout_s: float) -> SliceRequest:
        """The same request with another time-out."""
        return dataclasses.replace(self, timeout_s=timeout_s)


@dataclass(frozen=True)
class ClusterSlice:
    """One slice of the cluster as status shows it; ``holder`` names who holds it
    (empty: free)."""

    name: str
    accelerator_type: str
    num_hosts: int
    holder: str = ""
