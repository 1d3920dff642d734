"""Jobs (DESIGN §3): submitted step functions that outlive their client. The job's types
are :mod:`jaxpod.jobs`'s; these are the parts of the service that run jobs.

* :mod:`jaxpod.service.jobs.states` -- the job state machine: one small class per state,
  carrying its data, and the allowed transitions in one place;
* :mod:`jaxpod.service.jobs.controller` -- ``JobController``: one job's life as that
  state machine (``_step(state) -> next state``), every change told to callbacks;
* :mod:`jaxpod.service.jobs.policies` -- what decides: the failure policy (retry
  budgets) and the queue policy (FIFO per accelerator type), each behind a Protocol;
* :mod:`jaxpod.service.jobs.manager` -- ``JobManager``: what the job RPCs call: submit,
  cancel, and the reads that show jobs as they are now;
* :mod:`jaxpod.service.jobs.dispatcher` -- ``Dispatcher``: the queue, quotas and
  preemption, and one controller thread per started job;
* :mod:`jaxpod.service.jobs.bookkeeping`, :mod:`jaxpod.service.jobs.events` -- what every
  state change updates: the store, the goodput clock and a finished fork's pin; the
  watchers;
* :mod:`jaxpod.service.jobs.runner` -- one attempt of a job on a held slice: the loop of
  ``steps_per_run`` steps, outputs reduced into metrics, the hosts' reports read;
* :mod:`jaxpod.service.jobs.store` -- ``JobStore``: jobs, their history, attempts,
  metrics, logs and results in SQLite (WAL) under the state dir, built on
  :mod:`~jaxpod.service.jobs.store_reports` (what running jobs report),
  :mod:`~jaxpod.service.jobs.store_database` (the file, schema migrations,
  transactions) and :mod:`~jaxpod.service.jobs.store_rows` (rows as jaxpod's types);
  :mod:`~jaxpod.service.jobs.codec` and :mod:`~jaxpod.service.jobs.files` keep trees
  and files for it;
* :mod:`jaxpod.service.jobs.checkpoints`, :mod:`jaxpod.service.jobs.goodput` -- a job's
  checkpoints (and the steps its forks pin) and where its wall time goes;
* :mod:`jaxpod.service.api.jobs` -- the job RPCs (a mixin of the coordinator), where
  job types become protobuf messages and back (:mod:`jaxpod.proto.job_messages`).

The job code never sees a protobuf message: what the store keeps in the wire's format
(a spec, a tree's skeleton) it gets as bytes from :mod:`jaxpod.proto.stored`.

Nothing is imported here, so importing one part does not load the others.
"""
