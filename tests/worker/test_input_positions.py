"""A job's input says where it is, and a resumed attempt starts there.

Every step a host feed builds carries the position the next step starts at
(:class:`jaxpod.jobs.Epochs`); an input started at that position must feed exactly the
steps the uninterrupted input fed after it, and a seekable input must not read any
element the checkpointed steps consumed. The element a step starts in is computed here
with numpy from the elements' row counts, independently of the feeds.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
import pytest

import jaxpod
from jaxpod.jobs import Epochs, EpochsFn
from jaxpod.worker.input import FunctionFeed, HostReplicas, RebatchFeed

#: Rows of each element (uneven, so steps start inside elements); 40 elements.
SIZES = [4, 3, 7, 1, 5, 2, 6, 3] * 5


def element(i: int, rows: int) -> dict[str, np.ndarray]:
    """Element ``i``: its rows say which element and row they are."""
    return {"id": np.full((rows,), i, np.int32),
            "x": np.stack([np.full(rows, i), np.arange(rows)], 1).astype(np.float32)}


class Recorded:
    """Makes elements and records which ones its datasets read (from any thread).

    Args:
      sizes: rows of each element (default :data:`SIZES`).
    """

    def __init__(self, sizes: list[int] = SIZES) -> None:
        self.reads: list[int] = []
        self._sizes = sizes
        self._lock = threading.Lock()

    def read(self, i: int) -> dict[str, np.ndarray]:
        with self._lock:
            self.reads.append(i)
        return element(i, self._sizes[i])


class ListLike:
    """A random-access dataset (``__len__``/``__getitem__``), as a list of batches."""

    def __init__(self, recorder: Recorded) -> None:
        self._recorder = recorder

    def __len__(self) -> int:
        return len(SIZES)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self._recorder.read(i)


class Replayed:
    """Re-iterable but not seekable: a resumed input reads it again from the start."""

    def __init__(self, recorder: Recorded) -> None:
        self._recorder = recorder

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self._recorder.read(i) for i in range(len(SIZES)))


def grain_map(recorder: Recorded) -> Any:
    return grain.MapDataset.range(len(SIZES)).map(recorder.read)


def grain_iter(recorder: Recorded) -> Any:
    return grain_map(recorder).to_iter_dataset()


KINDS = {"list": ListLike, "grain.MapDataset": grain_map, "grain.IterDataset": grain_iter,
         "replayed": Replayed}
SEEKS = {"list", "grain.MapDataset", "grain.IterDataset"}


def layouts(per_host: list[int]) -> list[HostReplicas]:
    firsts = np.cumsum([0, *per_host])
    return [HostReplicas(int(firsts[h]), c, sum(per_host), min(per_host))
            for h, c in enumerate(per_host)]


def steps_of(feed: Any, n: int) -> list[Any]:
    """``n`` steps of a feed: rows (copied), counts, and the next step's position."""
    out = []
    for _ in range(n):
        step = feed.next_step()
        assert step is not None
        out.append(([np.array(leaf) for leaf in step.leaves], step.counts.copy(),
                    step.position))
    return out


def assert_same_steps(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for (g_leaves, g_counts, _), (w_leaves, w_counts, _) in zip(got, want, strict=True):
        np.testing.assert_array_equal(g_counts, w_counts)
        for g, w in zip(g_leaves, w_leaves, strict=True):
            np.testing.assert_array_equal(g, w)


def element_of_row(row: int) -> int:
    """numpy: the element (counted over epochs) holding global row ``row``."""
    ends = np.cumsum(SIZES)
    epoch, within = divmod(row, int(ends[-1]))
    return epoch * len(SIZES) + int(np.searchsorted(ends, within, side="right"))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("per_host", "global_batch"), [([4], None), ([2, 2], 6), ([3, 1], 9)])
@pytest.mark.parametrize("at_step", [1, 5, 14])
def test_a_rebatched_input_resumes_where_its_steps_ended(
        kind: str, per_host: list[int], global_batch: int | None, at_step: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    options = jaxpod.InputOptions(global_batch_size=global_batch)
    batch = global_batch or SIZES[0]
    # The list and the replayed input run into a second epoch (135 rows each); grain's
    # inputs read ahead on threads, so they stay in one to show they never read behind.
    steps = 24 if kind in ("list", "replayed") else sum(SIZES) // batch
    hosts = layouts(per_host)
    whole = [steps_of(RebatchFeed(Epochs(KINDS[kind](Recorded())), options, h), steps)
             for h in hosts]
    # Every host reads the whole stream; the last one takes a step's last rows, so its
    # position is where the next step starts without a row to skip past its element.
    start = {"at": whole[-1][at_step - 1][2], "batch": batch}
    first_element = element_of_row(at_step * batch)
    for h, host in enumerate(hosts):
        recorder = Recorded()
        resumed = RebatchFeed(Epochs(KINDS[kind](recorder), start), options, host)
        assert_same_steps(steps_of(resumed, steps - at_step), whole[h][at_step:])
        if kind == "list":  # read in order: exactly the elements from there on
            assert recorder.reads == [(first_element + j) % len(SIZES)
                                      for j in range(len(recorder.reads))]
        elif kind in SEEKS:  # grain may read ahead, never behind
            assert min(recorder.reads) == first_element and first_element in recorder.reads
        else:
            assert recorder.reads[:first_element] == list(
                itertools.islice(itertools.cycle(range(len(SIZES))), first_element))
            if first_element:
                assert f"{first_element} element(s) read again" in capsys.readouterr().out


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("at_step", [1, 4, 7])
def test_per_host_pipelines_resume_where_each_host_was(
        kind: str, at_step: int, capsys: pytest.CaptureFixture[str]) -> None:
    replicas, steps, num_hosts = 2, 12, 2

    def pipelines(recorders: list[Recorded], starts: tuple[Any, ...] = ()) -> list[Any]:
        fn = EpochsFn(lambda ctx: KINDS[kind](recorders[ctx.input_pipeline_id]), starts)
        return [FunctionFeed(fn(jaxpod.InputContext(num_input_pipelines=num_hosts,
                                                    input_pipeline_id=h,
                                                    num_replicas_in_sync=4)), replicas)
                for h in range(num_hosts)]

    # Per-replica batches of 3 rows, some short: a resumed host starting at a short one
    # keeps the original run's per-replica batch.
    sizes = [3, 3, 2] * 14
    feeds = pipelines([Recorded(sizes), Recorded(sizes)])
    whole = [steps_of(feed, steps) for feed in feeds]
    starts = tuple({"at": host[at_step - 1][2], **feed.batch_of_record()}
                   for host, feed in zip(whole, feeds, strict=True))
    recorders = [Recorded(sizes), Recorded(sizes)]
    for h, feed in enumerate(pipelines(recorders, starts)):
        assert_same_steps(steps_of(feed, steps - at_step), whole[h][at_step:])
        consumed = at_step * replicas  # one element per replica per step
        if kind in SEEKS:
            assert min(recorders[h].reads) == consumed and consumed in recorders[h].reads
        else:
            assert recorders[h].reads[:consumed] == list(range(consumed))
    if kind not in SEEKS:
        assert f"{at_step * replicas} element(s) read again" in capsys.readouterr().out
