"""Job checkpoints on disk, and the input a resumed attempt rebuilds.

A checkpoint folder counts only once its marker is written; a process SIGKILLed while
writing one (held inside the write by a hook) leaves the previous checkpoint the latest
usable one. Resumed inputs are compared row by row with numpy's cut of the same stream.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxpod import InputContext
from jaxpod.jobs import Epochs, EpochsFn, ResumedInput, ResumedInputFn
from jaxpod.service.jobs.checkpoints import COMMITTED, JobCheckpoints
from jaxpod.shipping import ship_object
from jaxpod.timeouts import Deadline


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "step": np.int32(seed),
            "nested": [rng.normal(size=5), (np.float32(seed), None)]}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if a is None:
        return b is None
    return bool(np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b))


def test_the_latest_committed_checkpoint_is_read_back_bit_for_bit(tmp_path: Path) -> None:
    checkpoints = JobCheckpoints(tmp_path / "ckpt", keep=2)
    assert checkpoints.latest() is None
    for step in (4, 8, 12):
        checkpoints.save_async(step, _state(step))  # each waits for the previous
    checkpoints.wait()
    assert checkpoints.steps() == [8, 12]  # the last two kept
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 12 and _equal(latest.state, _state(12))
    checkpoints.save(12, _state(99))  # a resumed attempt saving the same step again
    assert checkpoints.steps() == [8, 12]
    again = JobCheckpoints(tmp_path / "ckpt").latest()
    assert again is not None and _equal(again.state, _state(99))
    checkpoints.remove_all()
    assert not (tmp_path / "ckpt").exists()
    checkpoints.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        JobCheckpoints(tmp_path, keep=0)
    checkpoints = JobCheckpoints(tmp_path)
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoints.save(-1, None)
    from jaxpod.service.jobs.store import JobStoreError

    with pytest.raises(JobStoreError, match="Cannot store"):
        checkpoints.save(1, {"w": object()})
    assert checkpoints.steps() == [] and list(tmp_path.iterdir()) == []  # nothing left
    checkpoints.close()


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading
        import numpy as np
        from jaxpod.service.jobs.checkpoints import JobCheckpoints

        def hold(folder):  # the files are written, the marker is not: crash here
            print("WRITING", folder, flush=True)
            threading.Event().wait()

        JobCheckpoints({str(root)!r}).save(5, {{"w": np.arange(4.0)}})
        JobCheckpoints({str(root)!r}, before_commit=hold).save(
            10, {{"w": np.arange(1e6)}})
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()  # blocks until the hook runs (or the child dies)
        assert line.startswith("WRITING"), line
        partial = Path(line.split(" ", 1)[1].strip())
        assert (partial / "leaf_0.npy").is_file() and not (partial / COMMITTED).exists()
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(Deadline(30).remaining())
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        if writer.stdout:
            writer.stdout.close()
    reopened = JobCheckpoints(root)
    latest = reopened.latest()
    assert latest is not None and latest.step == 5
    np.testing.assert_array_equal(latest.state["w"], np.arange(4.0))
    assert not partial.exists()  # removed as not a checkpoint
    reopened.close()


# ------------------------------------------------------------------ resumed input
def _rows_of_steps(batches: list[dict[str, np.ndarray]], first: int, count: int
                   ) -> list[dict[str, np.ndarray]]:
    """numpy: the stream of rows, repeated, cut into global batches of the first
    batch's size; steps ``first`` .. ``first + count - 1``."""
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    total, size = len(rows["y"]), len(batches[0]["y"])
    return [{k: v[np.arange(s * size, (s + 1) * size) % total] for k, v in rows.items()}
            for s in range(first, first + count)]


@pytest.mark.parametrize("step", [0, 1, 2, 5, 11])
def test_a_resumed_dataset_feeds_the_steps_after_its_checkpoint(step: int) -> None:
    rng = np.random.default_rng(step)
    batches = [{"x": rng.normal(size=(n, 2)).astype(np.float32),
                "y": np.arange(n, dtype=np.int32) + 100 * i}
               for i, n in enumerate([14, 14, 9])]
    shipped = ship_object(Epochs(batches), "dataset", "")
    resumed = ResumedInput(shipped.payload, shipped.versions, step)
    got = list(itertools.islice(iter(resumed), 6))
    for g, expected in zip(got, _rows_of_steps(batches, step, 6), strict=True):
        assert g.keys() == expected.keys()
        for k in g:
            assert g[k].dtype == expected[k].dtype
            np.testing.assert_array_equal(g[k], expected[k])


def test_a_resumed_dataset_fn_skips_each_hosts_consumed_elements() -> None:
    def dataset_fn(ctx: Any) -> list[int]:
        return [100 * ctx.input_pipeline_id + i for i in range(5)]

    shipped = ship_object(EpochsFn(dataset_fn), "dataset_fn", "")
    for host in range(2):
        ctx = InputContext(num_input_pipelines=2, input_pipeline_id=host,
                               num_replicas_in_sync=8)
        resumed = ResumedInputFn(shipped.payload, shipped.versions, 3)(ctx)
        # 3 steps x 4 local replicas = 12 elements consumed; the pipeline repeats (5).
        expected = [100 * host + i % 5 for i in range(12, 20)]
        assert list(itertools.islice(iter(resumed), 8)) == expected
