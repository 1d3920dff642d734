"""Paths on the storage every host of a slice reaches: a local folder or a URL such as
``gs://bucket/jobs`` (checkpoints and profiles live there)."""

from __future__ import annotations


def join(root: str, *parts: str) -> str:
    """``root`` and ``parts`` joined with ``/`` (a local path or a URL such as gs://)."""
    return "/".join([root.rstrip("/"), *parts])
