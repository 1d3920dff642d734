"""Jobs (DESIGN §3, issue 15): submitted step functions that outlive their client.

* :mod:`jaxpod.service.jobs.states` -- the job state machine: one small class per state,
  the allowed transitions in one place;
* :mod:`jaxpod.service.jobs.store` -- ``JobStore``: jobs, their history, attempts,
  metrics, logs and results in SQLite (WAL) under the state dir, with schema migrations;
* :mod:`jaxpod.service.jobs.manager` -- ``JobManager``: a FIFO queue per accelerator
  type, the dispatcher, one runner thread per job, cancellation and retry budgets;
* :mod:`jaxpod.service.jobs.runner` -- one attempt of a job on a held slice: the loop of
  ``steps_per_run`` steps, outputs reduced into metrics, logs collected;
* :mod:`jaxpod.service.jobs.handlers` -- the job RPCs (a mixin of the coordinator).

Nothing is imported here, so importing one part does not load the others.
"""
