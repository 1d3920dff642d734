"""Test set-up shared by every suite.

JAX reads its CPU device count once, when its backend starts, so the in-process tests
fix 8 simulated devices here, before anything touches a device; tests for 1 and 2
replicas run on sub-meshes of them (``DeviceAssignment.build(jax.devices()[:n])``).
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


#: The state dir this run made for the services its tests start (``None``: the user's
#: own ``JAXPOD_STATE_DIR`` stays).
_OWN_STATE_DIR: list[str] = []


def pytest_configure(config: object) -> None:
    # Every `jaxpod serve` a test starts keeps its jobs here unless it names its own
    # --state-dir: never in the user's ~/.local/state.
    import os
    import tempfile

    # A pytest-xdist worker (PYTEST_XDIST_WORKER) always makes its own: it inherits the
    # controller's folder, and two services must not share one job database.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if "JAXPOD_STATE_DIR" not in os.environ or worker is not None:
        os.environ["JAXPOD_STATE_DIR"] = tempfile.mkdtemp(
            prefix=f"jaxpod-test-state-{worker or ''}")
        _OWN_STATE_DIR.append(os.environ["JAXPOD_STATE_DIR"])
    # Nor do their hosts' compiled programs go to the user's ~/.cache.
    os.environ.setdefault("JAXPOD_COMPILATION_CACHE_DIR",
                          os.path.join(os.environ["JAXPOD_STATE_DIR"], "compilation-cache"))
    # Nor their in-memory checkpoints to this machine's /dev/shm, which outlives the run.
    os.environ.setdefault("JAXPOD_MEMORY_CHECKPOINT_DIR",
                          os.path.join(os.environ["JAXPOD_STATE_DIR"], "memory"))


def pytest_unconfigure(config: object) -> None:
    import os
    import shutil

    for folder in _OWN_STATE_DIR:
        os.environ.pop("JAXPOD_STATE_DIR", None)
        os.environ.pop("JAXPOD_COMPILATION_CACHE_DIR", None)
        os.environ.pop("JAXPOD_MEMORY_CHECKPOINT_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: object, items: list) -> None:
    # pytest-xdist (.ci/run: ``-n 2 --dist loadfile``) keys tests by node id: of tests
    # sharing one it would run one and drop the others unseen.
    import collections

    import pytest

    repeated = [nodeid for nodeid, n in collections.Counter(i.nodeid for i in items).items()
                if n > 1]
    if repeated:
        raise pytest.UsageError(f"tests share node ids {repeated}; give each its own "
                                "(pytest.mark.parametrize ids=...)")
    # The longest files first: xdist hands files out in this order, so the run does not
    # end with one worker on a long file while the other has nothing left (a tail of
    # minutes on 2 cores). Within a file the order stays.
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))


#: Test files by their time on 2 cores (CI's --durations), longest first.
SLOW_FIRST = ("test_examples.py", "test_teams.py", "test_multihost_input.py",
              "test_job_faults.py", "test_elastic_jobs.py", "test_play_local.py",
              "test_exit.py", "test_slice_allocator.py", "test_profiles.py",
              "test_warm_slices.py", "test_host_workers.py", "test_job_checkpoints.py",
              "test_roles.py", "test_local_cluster.py", "test_jobs.py",
              "test_suspend_resume.py", "test_priorities.py")
