"""jaxpod.service: the coordinator (``jaxpod serve``), in packages by responsibility.

Read it bottom up; each package imports only those above it in this list:

* :mod:`~jaxpod.service.slices` -- driving one held slice: the handle on its host
  workers (``ReplicaGroup``), the strategy methods over them (``GroupEngine``), the
  held slice with the objects made on it, profiles of it;
* :mod:`~jaxpod.service.capacity` -- where slices come from: the TPU topology table,
  the resolvers (GKE, GCE, Ray, local), the Ray allocator, the pools that start a
  slice's workers and keep released ones warm, the simulated local cluster (Ray or
  plain processes), the orphan sweep;
* :mod:`~jaxpod.service.auth` -- who may do what: tokens, roles, slice quotas;
* :mod:`~jaxpod.service.sessions` -- interactive clients' sessions and what they hold;
* :mod:`~jaxpod.service.jobs` -- jobs: the queue, the controller's state machine, the
  runner of an attempt, the SQLite store, checkpoints, goodput;
* :mod:`~jaxpod.service.api` -- the gRPC edge: the servicers, the send-ahead of the
  operation stream, errors as statuses, the server; the one place (with the HTTP
  dashboard's reads) that turns protobuf messages into the service's types;
* :mod:`~jaxpod.service.http` -- the HTTP dashboard and API, Prometheus metrics;
* :mod:`~jaxpod.service.cli` -- the commands: ``jaxpod serve`` (and the process it
  runs), ``jaxpod cluster``, ``jaxpod deploy render``.

``docs/architecture.md`` draws them and follows one ``strategy.run`` and one
``client.submit`` through them. Nothing is imported here, so ``import jaxpod.service``
stays cheap (no Ray, no JAX).
"""
