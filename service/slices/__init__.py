"""Driving one held slice.

* :mod:`~jaxpod.service.slices.replica_group` -- ``ReplicaGroup``: the coordinator's
  handle on a slice's host workers, one operation at a time to all of them over their
  operation channels, in lockstep (a ``WorkerLauncher`` starts them: Ray actors or
  plain processes, see :mod:`jaxpod.service.capacity`);
* :mod:`~jaxpod.service.slices.group_engine` -- ``GroupEngine``: the strategy methods
  over a replica group;
* :mod:`~jaxpod.service.slices.group_results` -- ``GroupResults``: the engine's results as
  numpy (large results come in blocks);
* :mod:`~jaxpod.service.slices.group_handles` -- ``GroupValue``, ``DefinedFunction``,
  ``GroupDataset``, ``GroupIterator``: what stays on the workers, and the queue that
  frees it;
* :mod:`~jaxpod.service.slices.held` -- ``HeldSlice``: an acquired slice, its engine and
  the values, datasets and iterators made on it;
* :mod:`~jaxpod.service.slices.profiles` -- ``jax.profiler`` traces of a slice's hosts.

Imports :mod:`jaxpod.worker` (the workers it starts) and nothing else of the service.
"""
