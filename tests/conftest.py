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

    if "JAXPOD_STATE_DIR" not in os.environ:
        os.environ["JAXPOD_STATE_DIR"] = tempfile.mkdtemp(prefix="jaxpod-test-state-")
        _OWN_STATE_DIR.append(os.environ["JAXPOD_STATE_DIR"])
    # Nor do their hosts' compiled programs go to the user's ~/.cache.
    os.environ.setdefault("JAXPOD_COMPILATION_CACHE_DIR",
                          os.path.join(os.environ["JAXPOD_STATE_DIR"], "compilation-cache"))


def pytest_unconfigure(config: object) -> None:
    import os
    import shutil

    for folder in _OWN_STATE_DIR:
        os.environ.pop("JAXPOD_STATE_DIR", None)
        os.environ.pop("JAXPOD_COMPILATION_CACHE_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)
