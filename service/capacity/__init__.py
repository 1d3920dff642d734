"""Where slices come from, and where they go back to.

* :mod:`~jaxpod.service.capacity.topology` -- the TPU topology table
  (``slice_shape("v4-16")``);
* :mod:`~jaxpod.service.capacity.resolvers` -- one resolver per environment (GKE
  variables, GCE metadata, Ray, local devices), ``auto()`` and ``TPUClusterResolver``;
* :mod:`~jaxpod.service.capacity.allocator` -- ``SliceAllocator``: whole slices on Ray
  (placement groups), or nothing; :mod:`~jaxpod.service.capacity.allocation_steps`
  takes the steps of one request, :mod:`~jaxpod.service.capacity.allocation` is what
  it hands out (``Allocation``) and gives back;
* :mod:`~jaxpod.service.capacity.pools` -- slice providers: start a held slice's host
  workers, keep released slices warm (``RaySlices``);
  :mod:`~jaxpod.service.capacity.ray_workers` starts the workers as Ray actors;
* :mod:`~jaxpod.service.capacity.process_slices`,
  :mod:`~jaxpod.service.capacity.process_hosts` -- simulated slices whose hosts are
  plain processes of this machine (``--provider processes``, the embedded default);
* :mod:`~jaxpod.service.capacity.local_cluster` -- ``LocalTPUCluster``: a local Ray
  cluster whose nodes advertise simulated TPU hosts;
* :mod:`~jaxpod.service.capacity.deferred` -- the provider of a service that listens
  before its cluster is up;
* :mod:`~jaxpod.service.capacity.orphans` -- the sweep of a dead coordinator's Ray
  objects.

Imports :mod:`jaxpod.service.slices` (what a provider hands out); never sessions, jobs,
the API or HTTP.
"""
