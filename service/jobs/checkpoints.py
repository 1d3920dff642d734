"""Automatic checkpoints of a job: its state and input position, with no user code.

A checkpoint is a folder ``<job dir>/checkpoints/step-<N>/`` holding one ``.npy`` file
per array of the job's state (as numpy: replica 0's copy, since jobs train mirrored
state; plain ``.npy``, written in one call each, not a zip that checksums and copies
every byte again), ``tree.pb`` (the state's structure, :mod:`~jaxpod.service.jobs.codec`)
and ``meta.json`` (the step, which is also the input position: the input is rebuilt
and the rows or elements of the first ``N`` steps skipped). It is written under a
temporary name,
every file fsynced, then the ``COMMITTED`` marker is written last and the folder renamed
into place, so a crash at any moment leaves the previous checkpoint the latest usable
one; half-written folders are removed the next time the job's checkpoints are opened.

Checkpoints are written by the coordinator into its state dir, not by the hosts: a
preempted slice's hosts (and their disks) are gone, and the next attempt may run on
another slice; the state dir is the one place every attempt can read. The bytes are
fetched from the slice at a loop boundary (they change with the next loop) and written
on a background thread while the job's next steps run; the last ``keep`` are kept.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpod.service.jobs.codec import join_tree, split_tree
from jaxpod.service.jobs.files import sync_dir, write_synced

logger = logging.getLogger(__name__)

COMMITTED = "COMMITTED"
_TREE = "tree.pb"
#: Checkpoints kept per job (older ones are removed once a newer one is committed).
DEFAULT_KEEP = 2
_PREFIX = "step-"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: ``step`` steps were done; ``state`` is numpy."""

    step: int
    state: Any
    path: Path
    saved_at: float


class JobCheckpoints:
    """The checkpoints of one job.

    Args:
      root: the job's checkpoint folder (created when first needed).
      keep: committed checkpoints to keep.
      before_commit: called with the folder about to be committed, after its files
        are written (tests inject a crash there).
    """

    def __init__(self, root: Path, keep: int = DEFAULT_KEEP,
                 before_commit: Callable[[Path], None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 checkpoint; got {keep}.")
        self.root = Path(root)
        self.keep = keep
        self._before_commit = before_commit
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpod-ckpt")
        self._pending: concurrent.futures.Future[Path] | None = None
        self._lock = threading.Lock()
        self._remove_partial()

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            if entry.name.startswith(_PREFIX) and (entry / COMMITTED).is_file():
                try:
                    found.append(int(entry.name[len(_PREFIX):]))
                except ValueError:
                    continue
        return sorted(found)

    def listed(self) -> list[tuple[int, Path, float]]:
        """Each committed checkpoint's step, folder and save time, oldest first (their
        states are not read)."""
        listed = []
        for step in self.steps():
            path = self._folder(step)
            try:
                saved_at = float(json.loads((path / "meta.json").read_text())["saved_at"])
            except (OSError, ValueError, KeyError):  # pruned meanwhile
                continue
            listed.append((step, path, saved_at))
        return listed

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, or None."""
        steps = self.steps()
        if not steps:
            return None
        path = self._folder(steps[-1])
        meta = json.loads((path / "meta.json").read_text())
        arrays = [np.load(path / f"leaf_{i}.npy", allow_pickle=False)
                  for i in range(int(meta["leaves"]))]
        state = join_tree((path / _TREE).read_bytes(), arrays)
        return Checkpoint(int(meta["step"]), state, path, float(meta["saved_at"]))

    # ------------------------------------------------------------------ writing
    def save(self, step: int, state: Any) -> Path:
        """Writes a checkpoint now and returns its folder (after any pending save).
        Removing the oldest ones beyond ``keep`` is left to the writer thread (nobody
        waits for unlinking; the next save or :meth:`wait` does)."""
        self.wait()
        folder = self._write(step, state)
        with self._lock:
            self._pending = self._writer.submit(self._prune_returning, folder)
        return folder

    def save_async(self, step: int, state: Any) -> None:
        """Writes a checkpoint on the background thread; the caller goes on. A save
        still running is waited for first (at most one is in flight)."""
        self.wait()
        with self._lock:
            self._pending = self._writer.submit(
                lambda: self._prune_returning(self._write(step, state)))

    def wait(self) -> Path | None:
        """Waits for the save in flight, if any; raises what it raised."""
        with self._lock:
            pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Waits for the save in flight, then stops the writer thread."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def remove_all(self) -> None:
        """Deletes every checkpoint of the job (it is over)."""
        self.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def _write(self, step: int, state: Any) -> Path:
        if step < 0:
            raise ValueError(f"A checkpoint's step must be >= 0; got {step}.")
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self._folder(step)
        tmp = self.root / f".{final.name}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()
        try:
            skeleton, arrays = split_tree(state, "the job's state")
            for i, array in enumerate(arrays):
                with open(tmp / f"leaf_{i}.npy", "wb") as f:
                    np.save(f, np.asarray(array), allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
            write_synced(tmp / _TREE, skeleton)
            write_synced(tmp / "meta.json", json.dumps(
                {"step": step, "saved_at": time.time(), "leaves": len(arrays)}).encode())
            if self._before_commit is not None:
                self._before_commit(tmp)
            write_synced(tmp / COMMITTED, b"")  # last: only now is it a checkpoint
            sync_dir(tmp)
            if final.exists():  # the same step again (a resumed attempt): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            sync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("checkpoint %s written in %.3fs", final, time.monotonic() - started)
        return final

    def _prune_returning(self, folder: Path) -> Path:
        for step in self.steps()[:-self.keep]:
            shutil.rmtree(self._folder(step), ignore_errors=True)
        return folder

    def _remove_partial(self) -> None:
        """Folders a crash left half-written (no marker) are not checkpoints."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.is_dir() and not (entry / COMMITTED).is_file():
                shutil.rmtree(entry, ignore_errors=True)

    def _folder(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step}"
