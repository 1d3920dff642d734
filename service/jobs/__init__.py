"""Jobs (DESIGN §3, issue 15): submitted step functions that outlive their client.

* :mod:`jaxpod.service.jobs.states` -- the job state machine: one small class per state,
  the allowed transitions in one place;
* :mod:`jaxpod.service.jobs.store` -- ``JobStore``: jobs, their history, attempts,
  metrics, logs and results in SQLite (WAL) under the state dir, with schema migrations.

Nothing is imported here, so importing one part does not load the others.
"""
