"""What ``client.submit`` checks and ships before it asks the service anything, and how
``jaxpod submit FILE.py`` reads a job file; no service runs here.

Every bad argument is refused on the client with a message naming what was received
and how to fix it. Good arguments ship as the :mod:`jaxpod.jobs` wrappers the workers
run, pickled by value: a job file's functions and the modules next to it unpickle in
a process that has neither. The job commands need a running service and say how to
name one when none is given (they never start the embedded service).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

from jaxpod.client.client import Client
from jaxpod.client.jobs import (
    SUBMIT_DEFAULTS,
    SUBMIT_KEYWORDS,
    build_spec,
    check_state,
    status_from,
)
from jaxpod.errors import MessageTooLargeError
from jaxpod.jobs import Epochs, EpochsFn, InitialState, JobState, JobStep
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.types import InputContext

JAXPOD = Path(sys.executable).with_name("jaxpod")  # the console script of this venv
COMMAND_TIMEOUT_S = 120.0
BATCH = np.arange(8, dtype=np.float32).reshape(4, 2)


def _step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    return state + batch.sum(axis=0), {"loss": batch.mean(), "extra": 1.0}


def _spec(step_fn: Any = _step, **kwargs: Any) -> pb.JobSpec:
    arguments = {**SUBMIT_DEFAULTS, "steps": 10, **kwargs}
    return build_spec(step_fn, **arguments)


def _generator() -> Iterator[np.ndarray]:
    yield BATCH


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"step_fn": 42}, TypeError, ["step_fn", "int 42", "Pass the function itself"]),
    ({"steps": 0}, ValueError, ["steps must be an int >= 1", "Got 0", "steps=1000"]),
    ({"steps": 2.5}, TypeError, ["steps", "float 2.5"]),
    ({"steps": True}, TypeError, ["steps", "bool True"]),
    ({"steps": "100"}, TypeError, ["steps", "str '100'"]),
    ({"steps_per_run": 0}, ValueError, ["steps_per_run", "Got 0", "steps_per_run=10"]),
    ({"num_slices": -1}, ValueError, ["num_slices", "Got -1"]),
    ({"max_retries_preemption": -1}, ValueError, ["max_retries_preemption", ">= 0", "Got -1"]),
    ({"max_retries_failure": 1.0}, TypeError, ["max_retries_failure", "float 1.0"]),
    ({"checkpoint_every": 0}, ValueError, ["checkpoint_every", "Got 0", "or None"]),
    ({"accelerator_type": 16}, TypeError, ["accelerator_type", "int 16", "'v4-16'"]),
    ({"accelerator_type": ()}, TypeError, ["accelerator_type", "tuple ()",
                                           "('v4-16', 'v4-8')"]),
    ({"accelerator_type": ("v4-16", 8)}, TypeError, ["accelerator_type", "('v4-16', 8)"]),
    ({"grow_back": "yes"}, TypeError, ["grow_back must be True", "str 'yes'"]),
    ({"accelerator_type": ["v4-8", "v4-16", "v4-8"]}, ValueError,
     ["['v4-8'] more than once", "name each slice type once"]),
    ({"name": 7}, TypeError, ["name must be a string", "int 7"]),
    ({"init_fn": lambda: 0, "initial_state": np.zeros(2)}, ValueError,
     ["both init_fn and initial_state", "pass one of them"]),
    ({"init_fn": np.zeros(2)}, TypeError, ["init_fn must be a function", "ndarray",
                                           "initial_state=..."]),
    ({"dataset": [BATCH], "dataset_fn": lambda ctx: [BATCH]}, ValueError,
     ["both dataset and dataset_fn", "pass one of them"]),
    ({"dataset": 5}, TypeError, ["dataset must be an iterable", "int 5"]),
    ({"dataset": _generator()}, TypeError,
     ["re-iterable", "generator", "dataset=list(batches)", "dataset_fn"]),
    ({"dataset": iter([BATCH])}, TypeError, ["re-iterable", "list_iterator", "list"]),
    ({"dataset_fn": [BATCH]}, TypeError, ["dataset_fn must be a function", "list",
                                          "dataset=..."]),
    ({"outputs": ["loss"]}, TypeError, ["outputs must be a dict", "list"]),
    ({"outputs": {"loss": "AVERAGE"}}, ValueError, ["unknown reduce op 'AVERAGE'", "MEAN"]),
])
def test_bad_arguments_are_refused_naming_the_value_and_the_fix(
        kwargs: dict[str, Any], error: type[Exception], says: list[str]) -> None:
    with pytest.raises(error) as raised:
        _spec(**kwargs)
    message = str(raised.value)
    missing = [s for s in says if s not in message]
    assert not missing, f"the message lacks {missing}: {message}"


def test_unpicklable_objects_are_refused_naming_them() -> None:
    lock = threading.Lock()

    def holds_a_lock(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        with lock:
            return state, {}

    with pytest.raises(TypeError, match=r"Cannot send step_fn .*holds_a_lock.*cannot be "
                                        r"pickled.*must not capture locks"):
        _spec(holds_a_lock)
    with pytest.raises(TypeError, match=r"Cannot send dataset \(list\).*cannot be pickled.*"
                                        r"list of batches"):
        _spec(dataset=[BATCH, lock])
    with pytest.raises(TypeError, match=r"Cannot send initial_state \(dict\)"):
        _spec(initial_state={"w": BATCH, "lock": lock})


def test_a_dataset_over_the_message_limit_says_to_use_dataset_fn() -> None:
    huge = [np.zeros(36 * 2**20, np.uint8), np.zeros(36 * 2**20, np.uint8)]
    with pytest.raises(MessageTooLargeError, match=r"most of it is dataset.*dataset_fn"):
        _spec(dataset=huge)


# ----------------------------------------------------------------- good input
def test_a_stateful_job_with_a_dataset_ships_its_wrapped_objects() -> None:
    state = np.ones(2, np.float32)
    spec = _spec(steps=np.int64(12), initial_state=state, dataset=[BATCH, BATCH * 2],
                 steps_per_run=4, outputs={"loss": "mean"}, checkpoint_every=6, name="lin",
                 max_retries_preemption=3, max_retries_failure=1)
    assert (spec.name, spec.accelerator_type, spec.num_slices, spec.steps) == (
        "lin", None, 1, 12)
    assert (spec.steps_per_run, spec.checkpoint_every) == (4, 6)
    assert (spec.max_retries_preemption, spec.max_retries_failure) == (3, 1)
    assert dict(spec.outputs) == {"loss": "MEAN"}
    assert set(spec.runtime_versions) == {"python", "jax", "cloudpickle"}
    assert spec.dataset_fn == b""

    step = cloudpickle.loads(spec.step_fn)
    assert isinstance(step, JobStep)
    assert (step.outputs, step.stateful, step.has_input) == (("loss",), True, True)
    new_state, outputs = step(state, BATCH)  # only the declared outputs are kept
    np.testing.assert_array_equal(new_state, state + BATCH.sum(axis=0))
    assert set(outputs) == {"loss"}

    init = cloudpickle.loads(spec.init_fn)
    assert isinstance(init, InitialState)
    np.testing.assert_array_equal(init(), state)

    dataset = cloudpickle.loads(spec.dataset)
    assert isinstance(dataset, Epochs)
    first = [batch for batch, _ in zip(dataset, range(5), strict=False)]
    np.testing.assert_array_equal(np.stack(first), np.stack([BATCH, BATCH * 2] * 2 + [BATCH]))


def test_several_accelerator_types_make_an_elastic_spec() -> None:
    spec = _spec(accelerator_type=["v4-16", "v4-8"])
    assert (spec.accelerator_type, spec.accelerator_types) == ("v4-16", ("v4-16", "v4-8"))
    assert spec.elastic and spec.preferences() == ("v4-16", "v4-8") and spec.grow_back
    assert not _spec(accelerator_type=["v4-16", "v4-8"], grow_back=False).grow_back
    one = _spec(accelerator_type=("v4-8",))  # one type in a sequence: not elastic
    assert (one.accelerator_type, one.accelerator_types, one.elastic) == ("v4-8", None, False)
    assert _spec().preferences() == ("",)


def test_a_job_with_init_fn_and_dataset_fn_ships_them() -> None:
    spec = _spec(init_fn=lambda: np.zeros(2, np.float32),
                 dataset_fn=lambda ctx: [BATCH + ctx.input_pipeline_id],
                 accelerator_type="v4-16", num_slices=2)
    assert (spec.accelerator_type, spec.num_slices, spec.checkpoint_every) == ("v4-16", 2, None)
    assert spec.dataset == b""
    np.testing.assert_array_equal(cloudpickle.loads(spec.init_fn)(), np.zeros(2))
    dataset_fn = cloudpickle.loads(spec.dataset_fn)
    assert isinstance(dataset_fn, EpochsFn)
    per_host = iter(dataset_fn(InputContext(num_input_pipelines=2, input_pipeline_id=1)))
    np.testing.assert_array_equal(next(per_host), BATCH + 1)
    np.testing.assert_array_equal(next(per_host), BATCH + 1)  # another epoch
    step = cloudpickle.loads(spec.step_fn)
    assert (step.outputs, step.stateful, step.has_input) == ((), True, True)


def test_a_job_without_state_or_input_ships_no_init_fn_or_dataset() -> None:
    calls: list[tuple[Any, Any]] = []

    def tick(state: Any, batch: Any) -> tuple[None, dict[str, Any]]:
        calls.append((state, batch))
        return None, {"one": 1.0}

    spec = _spec(tick, outputs={"one": "SUM"})
    assert (spec.init_fn, spec.dataset, spec.dataset_fn) == (b"", b"", b"")
    step = cloudpickle.loads(spec.step_fn)
    assert (step.stateful, step.has_input) == (False, False)
    assert step((), np.zeros(4)) == ((), {"one": 1.0})


def test_submit_signature_matches_the_shared_keywords_and_defaults() -> None:
    submit = inspect.signature(Client.submit).parameters
    keywords = {n: p.default for n, p in submit.items() if p.kind is p.KEYWORD_ONLY}
    assert tuple(keywords) == SUBMIT_KEYWORDS
    assert keywords == {"steps": inspect.Parameter.empty, **SUBMIT_DEFAULTS}
    spec_keywords = [n for n, p in inspect.signature(build_spec).parameters.items()
                     if p.kind is p.KEYWORD_ONLY]
    assert tuple(spec_keywords) == SUBMIT_KEYWORDS


# ----------------------------------------------------------- status messages
def test_status_from_maps_absent_fields_to_none() -> None:
    message = pb.JobStatus(id="j1", name="lin", state="PENDING", steps=10, created_at=5.0,
                           accelerator_type="v4-8")
    status = status_from(message)
    assert (status.queue_position, status.error, status.started_at, status.finished_at,
            status.goodput, status.steps_per_s) == (None, None, None, None, None, None)
    assert (status.created_at, status.accelerator_type, status.done) == (5.0, "v4-8", False)
    assert status.state is JobState.PENDING and status.state == "PENDING"
    message = pb.JobStatus(id="j1", name="lin", state="FAILED", step=3, steps=10,
                           attempts=2, queue_position=0, error="ValueError: boom",
                           metrics={"loss": 0.5}, created_at=1.0, started_at=2.0,
                           finished_at=3.0)
    status = status_from(message)
    assert (status.queue_position, status.error, status.metrics, status.started_at,
            status.finished_at, status.attempts, status.done) == (
        0, "ValueError: boom", {"loss": 0.5}, 2.0, 3.0, 2, True)


def test_status_from_carries_goodput_and_jaxpod_job_shows_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    from jaxpod.client.jobs_cli import _print_details
    from jaxpod.jobs import JobDetails

    goodput = {"queued": 1.0, "productive": 6.0, "compiling": 2.0, "lost_work": 0.0,
               "other": 1.0, "wall_s": 10.0, "productive_share": 0.6}
    message = pb.JobStatus(id="j1", name="lin", state="SUCCEEDED", step=3, steps=3,
                           created_at=1.0, goodput=goodput)
    status = status_from(message)
    assert status.goodput == goodput
    _print_details(JobDetails(status), as_json=False)
    out = capsys.readouterr().out
    section = out[out.index("goodput:"):].splitlines()
    assert section[0].split() == ["goodput:", "60.0%", "productive", "of", "10.000", "s",
                                  "wall", "time"]
    assert [line.split() for line in section[1:]] == [  # largest first, zeros left out
        ["productive", "6.000", "s", "60.0%"], ["compiling", "2.000", "s", "20.0%"],
        ["other", "1.000", "s", "10.0%"], ["queued", "1.000", "s", "10.0%"]]
    _print_details(JobDetails(status), as_json=True)
    assert json.loads(capsys.readouterr().out)["goodput"] == goodput
    _print_details(JobDetails(status_from(pb.JobStatus(id="j2", state="PENDING"))),
                   as_json=False)
    assert "goodput" not in capsys.readouterr().out


def test_job_states_are_checked_in_any_case() -> None:
    assert check_state(None) == ""
    assert check_state("running") == "RUNNING"
    with pytest.raises(ValueError, match=r"Unknown job state 'done'; expected one of "
                                         r"PENDING, .*CANCELLED"):
        check_state("done")


# ------------------------------------------------------------- jaxpod submit
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXPOD_ADDRESS", "JAXPOD_TOKEN")}
    return {**env, **extra}


def _jaxpod(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert JAXPOD.is_file(), f"no `jaxpod` console script next to {sys.executable}"
    return subprocess.run([str(JAXPOD), *args], capture_output=True, text=True, env=_env(),
                          cwd=cwd, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          check=False)


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


MODULE_LEVEL_JOB = """
    import numpy as np

    steps = 20
    steps_per_run = 5
    outputs = {"loss": "MEAN"}
    dataset = [np.full((4, 2), float(i), np.float32) for i in range(3)]
    initial_state = np.zeros(2, np.float32)
    SCALE = 0.5

    def step_fn(state, batch):
        return state + SCALE * batch.sum(0), {"loss": (batch ** 2).mean()}
"""

FUNCTION_JOB = """
    from {helpers} import make_batches, scale

    def job():
        def step_fn(state, batch):
            return scale(state, batch), {{"loss": batch.mean()}}
        return {{"step_fn": step_fn, "steps": 7, "dataset_fn": make_batches,
                "init_fn": lambda: 1.0, "outputs": {{"loss": "SUM"}}, "name": "fn-job"}}
"""

HELPERS = """
    import numpy as np

    def make_batches(context):
        return [np.full((2, 2), context.input_pipeline_id + 1.0)]

    def scale(state, batch):
        return state * 2 + batch.sum()
"""

# Loads a job file as `jaxpod submit` does, builds its spec and writes it out.
_LOAD = """
import sys
from jaxpod.client.jobs import SUBMIT_DEFAULTS, build_spec
from jaxpod.client.jobs_cli import load_job_file
from jaxpod.proto.job_messages import to_message

kwargs = load_job_file(sys.argv[1])
step_fn = kwargs.pop("step_fn")
print(step_fn.__module__)
spec = build_spec(step_fn, **{**SUBMIT_DEFAULTS, **kwargs})
open(sys.argv[2], "wb").write(to_message(spec).SerializeToString())
"""


def _load_in_a_fresh_interpreter(job_file: Path, out: Path) -> tuple[str, pb.JobSpec]:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(job_file), str(out)],
                          capture_output=True, text=True, env=_env(),
                          timeout=COMMAND_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), pb.JobSpec.FromString(out.read_bytes())


def test_a_job_file_of_module_level_names_ships_by_value(tmp_path: Path) -> None:
    job_file = _write(tmp_path / "linreg.py", MODULE_LEVEL_JOB)
    module, spec = _load_in_a_fresh_interpreter(job_file, tmp_path / "spec.bin")
    assert module not in ("__main__", "linreg") and module not in sys.modules
    assert (spec.steps, spec.steps_per_run, dict(spec.outputs)) == (20, 5, {"loss": "MEAN"})
    step = cloudpickle.loads(spec.step_fn)  # this process cannot import the file
    state, outputs = step(np.zeros(2, np.float32), np.ones((4, 2), np.float32))
    np.testing.assert_array_equal(state, [2.0, 2.0])  # SCALE travelled with the function
    assert float(outputs["loss"]) == 1.0
    dataset = iter(cloudpickle.loads(spec.dataset))
    assert [float(next(dataset)[0, 0]) for _ in range(4)] == [0.0, 1.0, 2.0, 0.0]
    np.testing.assert_array_equal(cloudpickle.loads(spec.init_fn)(), np.zeros(2))


def test_a_job_function_and_its_neighbour_modules_ship_by_value(tmp_path: Path) -> None:
    helpers = "jaxpod_test_job_helpers_7f3a"  # unique: must not be importable here
    _write(tmp_path / f"{helpers}.py", HELPERS)
    job_file = _write(tmp_path / "fn_job.py", FUNCTION_JOB.format(helpers=helpers))
    _, spec = _load_in_a_fresh_interpreter(job_file, tmp_path / "spec.bin")
    assert helpers not in sys.modules
    assert (spec.name, spec.steps, dict(spec.outputs)) == ("fn-job", 7, {"loss": "SUM"})
    step = cloudpickle.loads(spec.step_fn)
    state, outputs = step(1.0, np.ones((2, 2)))
    assert (state, float(outputs["loss"])) == (6.0, 1.0)
    assert cloudpickle.loads(spec.init_fn)() == 1.0
    per_host = iter(cloudpickle.loads(spec.dataset_fn)(
        InputContext(num_input_pipelines=2, input_pipeline_id=1)))
    np.testing.assert_array_equal(next(per_host), np.full((2, 2), 2.0))


def _check_refused(done: subprocess.CompletedProcess[str], *says: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    missing = [s for s in says if s not in done.stderr]
    assert not missing, f"stderr lacks {missing}: {done.stderr}"


def test_job_commands_without_an_address_say_how_to_give_one(tmp_path: Path) -> None:
    job_file = _write(tmp_path / "linreg.py", MODULE_LEVEL_JOB)
    # The file loads and its spec builds (nothing wrong with it) before the address is needed.
    _check_refused(_jaxpod("submit", str(job_file)), "`jaxpod submit` needs a running",
                   "--address", "JAXPOD_ADDRESS", "never start the embedded")
    for command in (("jobs",), ("job", "abc"), ("logs", "abc"), ("cancel", "abc")):
        _check_refused(_jaxpod(*command), f"`jaxpod {command[0]}` needs", "--address",
                       "JAXPOD_ADDRESS")
    # Said before the client's modules load: they import JAX (most of a second).
    probe = ("import sys\nfrom jaxpod.cli import main\n"
             "print(main(['jobs']), 'jax' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=_env(), timeout=COMMAND_TIMEOUT_S, check=False)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr


def test_jaxpod_submit_refuses_bad_job_files_before_connecting(tmp_path: Path) -> None:
    _check_refused(_jaxpod("submit", str(tmp_path / "missing.py")), "is not a file")
    empty = _write(tmp_path / "empty.py", "x = 1\n")
    _check_refused(_jaxpod("submit", str(empty)), "defines neither step_fn nor job()")
    no_steps = _write(tmp_path / "no_steps.py", "def step_fn(state, batch):\n"
                                                "    return None, {}\n")
    _check_refused(_jaxpod("submit", str(no_steps)), "sets no steps", "--steps N")
    # --steps supplies them: the file is fine, only the address is missing.
    _check_refused(_jaxpod("submit", str(no_steps), "--steps", "3"), "--address")
    generator = _write(tmp_path / "generator.py", """
        import numpy as np
        steps = 3
        dataset = (np.ones((4, 2)) for _ in range(3))
        def step_fn(state, batch):
            return None, {}
    """)
    _check_refused(_jaxpod("submit", str(generator)), "re-iterable", "generator")
    extra = _write(tmp_path / "extra.py", """
        def job():
            return {"step_fn": lambda s, b: (None, {}), "steps": 2, "epochs": 3}
    """)
    _check_refused(_jaxpod("submit", str(extra)), "['epochs']", "does not take")


@pytest.mark.parametrize("command", ["submit", "jobs", "job", "cancel"])
def test_job_command_help(command: str) -> None:
    done = _jaxpod(command, "--help")
    assert done.returncode == 0, done.stderr
    assert "--address" in done.stdout and "JAXPOD_ADDRESS" in done.stdout

