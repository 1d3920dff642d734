"""A job's metrics as TensorBoard scalars in its folder, beside its checkpoints and
profiles: ``tensorboard --logdir <checkpoint dir>/<job id>`` shows its loss curves and
its traces together, as MaxText and flax users expect.

The runner writes what the job store recorded since the last write (each declared
scalar output by step), with the attempt's steps per second and goodput at its last
step, as one new event file under ``<job>/tensorboard/`` each time: at every committed
checkpoint, at most every :data:`WRITE_EVERY_S` between them, and when the attempt ends.
A file is written whole, once, so an object store (``gs://``, through tensorboardX and
``google-cloud-storage``) takes it as well as a local folder. A resumed attempt writes
the steps it redoes again; TensorBoard drops the older points past a step that comes
again, as it does for a restarted TensorFlow job. Writing never fails the job: a
folder that cannot be written is reported once in the service's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from jaxpod.storage import join

logger = logging.getLogger(__name__)

#: The longest time between two writes while a job runs without checkpoints.
WRITE_EVERY_S = 60.0
#: The folder of the event files, in the job's folder.
FOLDER = "tensorboard"


class TensorBoardScalars:
    """Writes a job's new metric points as TensorBoard scalars.

    Args:
      job_folder: the job's folder (its checkpoints' directory).
      after: the last step already written (a resumed attempt's start).
      clock: monotonic seconds (tests inject a fake).
    """

    def __init__(self, job_folder: str, after: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = join(job_folder, FOLDER)
        self._after = after
        self._clock = clock
        self._written_at = clock()
        self._broken = False

    def due(self) -> bool:
        """Whether :data:`WRITE_EVERY_S` passed since the last write."""
        return self._clock() - self._written_at >= WRITE_EVERY_S

    def write(self, series: Mapping[str, list[tuple[int, float]]],
              at_last_step: Mapping[str, float]) -> None:
        """Writes ``series`` (name -> [(step, value)], the points after :attr:`after`)
        and ``at_last_step`` (name -> value, at the last step of ``series``) as one
        event file; nothing when there is no new point."""
        self._written_at = self._clock()
        steps = [s for points in series.values() for s, _ in points]
        if self._broken or not steps:
            return
        last = max(steps)
        try:
            from tensorboardX import SummaryWriter

            # One file per write, named after its last step: never appended to.
            writer = SummaryWriter(self.folder, flush_secs=3600,
                                   filename_suffix=f".step-{last}")
            try:
                for name, points in series.items():
                    for step, value in points:
                        writer.add_scalar(name, value, step)
                for name, value in at_last_step.items():
                    writer.add_scalar(name, value, last)
            finally:
                writer.close()
        except Exception as e:  # the job goes on; its metrics stay in the job store
            self._broken = True
            logger.warning("TensorBoard scalars cannot be written to %s (%s: %s); the "
                           "job's metrics stay in the service's job store only.",
                           self.folder, type(e).__name__, e)
            return
        self._after = last

    @property
    def after(self) -> int:
        """The last step written."""
        return self._after
