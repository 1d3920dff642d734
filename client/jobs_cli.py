"""The job commands of the ``jaxpod`` CLI: ``submit``, ``jobs``, ``job``, ``logs``,
``cancel``, ``suspend``, ``resume``, ``fork``, ``pin``, ``unpin``, ``profile`` and
``audit``.

They talk to a running ``jaxpod serve`` (``--address``, default ``$JAXPOD_ADDRESS``;
token from ``$JAXPOD_TOKEN``) and never start the embedded local service: a job must
outlive the command that submitted it. The client modules load only when a command
runs, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import runpy
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpod import settings

if TYPE_CHECKING:
    from jaxpod.client.client import Client
    from jaxpod.jobs import JobDetails, JobStatus

ADDRESS_ENV = settings.ADDRESS.name
TOKEN_ENV = settings.TOKEN.name


def _pipe_safe(handler: Callable[[argparse.Namespace], int]
               ) -> Callable[[argparse.Namespace], int]:
    """``handler``, ending quietly when its reader goes away (``jaxpod jobs | head``)."""
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:
            # Python would complain again flushing stdout at exit: point it at devnull.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    return run


def add_commands(sub: Any) -> None:
    """Adds the job commands to the ``jaxpod`` parser's subparsers."""
    submit = sub.add_parser(
        "submit", help="submit a job defined in a Python file and print its id",
        description="Submit a job. FILE.py defines step_fn(state, batch) -> (state, outputs) "
                    "and client.submit's keyword arguments (steps, dataset, outputs, ...) as "
                    "module-level names, or a function job() returning them all (step_fn "
                    "included) as a dict. Flags override what the file sets.")
    submit.add_argument("file", metavar="FILE.py", help="the job's Python file")
    submit.add_argument("--wait", action="store_true",
                        help="wait for the job (a progress bar on a terminal); exit 0 if it "
                             "SUCCEEDED, 1 otherwise")
    submit.add_argument("--name", default=None, help="the job's name (default: its id)")
    submit.add_argument("--steps", type=int, default=None, help="steps to run")
    submit.add_argument("--accelerator-type", default=None,
                        help="slice type, e.g. v4-16 (default: the cluster's first); "
                             "several, comma-separated in order of preference, make the "
                             "job elastic: v4-16,v4-8")
    submit.add_argument("--priority", type=int, default=None,
                        help="higher runs first and preempts running jobs of lower "
                             "priority (default 0)")
    _add_address(submit)
    submit.set_defaults(handler=_pipe_safe(run_submit))

    jobs = sub.add_parser("jobs", help="list the service's jobs")
    jobs.add_argument("--state", default=None,
                      help="only jobs in this state (PENDING, RUNNING, SUCCEEDED, ...)")
    jobs.add_argument("--json", action="store_true", help="print a JSON list")
    _add_address(jobs)
    jobs.set_defaults(handler=_pipe_safe(run_jobs))

    job = sub.add_parser(
        "job", help="show a job's status (--watch: follow it to the end); `job stacks ID`: "
                    "every host's Python stacks now",
        usage="jaxpod job [-h] [--watch] [--json] [--address ADDRESS] ID\n"
              "       jaxpod job stacks [--host N] [--address ADDRESS] ID")
    job.add_argument("job_id", metavar="ID", help="the job's id")
    job.add_argument("stacks_of", nargs="?", metavar="ID", default=None,
                     help=argparse.SUPPRESS)  # `jaxpod job stacks ID`
    job.add_argument("--watch", action="store_true",
                     help="print a line per change until the job is over")
    job.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    job.add_argument("--host", type=int, default=None, metavar="N",
                     help="with `stacks`: only host N's (its index in the slice)")
    _add_address(job)
    job.set_defaults(handler=_pipe_safe(run_job))

    logs = sub.add_parser(
        "logs", help="print what a job's code printed on its hosts (--follow: until the "
                     "job is over)")
    logs.add_argument("job_id", metavar="ID", help="the job's id")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new lines until the job is over")
    logs.add_argument("--host", type=int, default=None, metavar="N",
                      help="only host N's lines (its index in the slice), without the "
                           "[host N] prefix")
    _add_address(logs)
    logs.set_defaults(handler=_pipe_safe(run_logs))

    cancel = sub.add_parser("cancel", help="cancel a job and print its resulting state")
    cancel.add_argument("job_id", metavar="ID", help="the job's id")
    _add_address(cancel)
    cancel.set_defaults(handler=_pipe_safe(run_cancel))

    fork = sub.add_parser("fork", help="start a new job from one of a job's checkpoints "
                                       "and print its id")
    fork.add_argument("job_id", metavar="ID", help="the source job's id")
    fork.add_argument("--step", type=int, required=True,
                      help="the step of the source's checkpoint (`jaxpod job ID` lists them)")
    fork.add_argument("--steps", type=int, default=None,
                      help="the fork's last step (default: the source's)")
    fork.add_argument("--name", default=None, help="the fork's name")
    fork.add_argument("--priority", type=int, default=None, help="the fork's priority")
    _add_address(fork)
    fork.set_defaults(handler=_pipe_safe(run_fork))

    for verb, says in (("suspend", "checkpoint a job and free its slice until resumed"),
                       ("resume", "queue a suspended job again")):
        pause = sub.add_parser(verb, help=says)
        pause.add_argument("job_id", metavar="ID", help="the job's id")
        _add_address(pause)
        pause.set_defaults(handler=_pipe_safe(run_suspend), resume=verb == "resume")

    for verb, says in (("pin", "keep a job whole for ever: retention never prunes it"),
                       ("unpin", "let retention prune a job once it is finished and past "
                                 "the service's limits")):
        pin = sub.add_parser(verb, help=says)
        pin.add_argument("job_id", metavar="ID", help="the job's id")
        _add_address(pin)
        pin.set_defaults(handler=_pipe_safe(run_pin), pinned=verb == "pin")

    profile = sub.add_parser(
        "profile", help="trace every host of a running job with jax.profiler and print "
                        "where the trace is",
        description="Trace every host of a running job with jax.profiler for --seconds, "
                    "from its next loop boundary, and print the trace's folder (one "
                    "host-<i>/ per host, TensorBoard's layout: tensorboard --logdir FOLDER).")
    profile.add_argument("job_id", metavar="ID", help="the job's id")
    profile.add_argument("--seconds", type=float, default=5.0,
                         help="how long each host traces (default 5)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    _add_address(profile)
    profile.set_defaults(handler=_pipe_safe(run_profile))

    audit = sub.add_parser("audit", help="who submitted, cancelled or was refused what "
                                         "(an admin token's)")
    audit.add_argument("--limit", type=int, default=100,
                       help="the newest this many records (default 100)")
    audit.add_argument("--json", action="store_true", help="print a JSON list")
    _add_address(audit)
    audit.set_defaults(handler=_pipe_safe(run_audit))


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help=f"the `jaxpod serve` to talk to (default ${ADDRESS_ENV}); "
                             f"the token comes from ${TOKEN_ENV}, the CA of a service "
                             "served over TLS from $JAXPOD_TLS_CA")


def _address(args: argparse.Namespace) -> str:
    address = args.address or settings.ADDRESS.get()
    if not address:
        raise ValueError(
            f"`jaxpod {args.command}` needs a running jaxpod service: pass --address "
            f"HOST:PORT (the address `jaxpod serve` printed) or set {ADDRESS_ENV}. Job "
            "commands never start the embedded local service, because a job must outlive "
            "the command that submitted it.")
    return str(address)


def _connect(args: argparse.Namespace) -> Client:
    address = _address(args)  # before the client's imports (JAX): a missing one says so at once
    from jaxpod.client.client import connect
    from jaxpod.errors import ServiceUnavailableError

    try:
        return connect(address, settings.TOKEN.get())
    except ServiceUnavailableError as e:
        # The generic advice (unset the address for the embedded service) is wrong here.
        raise ServiceUnavailableError(
            f"`jaxpod {args.command}`: no jaxpod service answers at {address}. Check that "
            "`jaxpod serve` runs there (its JAXPOD_LISTENING line names the address), "
            f"that --address or ${ADDRESS_ENV} points at it, and, if it serves TLS, that "
            "$JAXPOD_TLS_CA names the CA that signed its certificate.") from e


# ------------------------------------------------------------------------ submit
def load_job_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``client.submit``'s keyword arguments (``step_fn`` included) from a job file.

    The file runs under a module name of its own that stays out of ``sys.modules``,
    so its functions and classes are pickled by value (the workers do not have the
    file). Its folder joins ``sys.path`` first, as ``python FILE.py`` would do, so it
    can import modules next to it (those are shipped by value too).

    Raises:
      ValueError: the file does not define a job (the message says what it must define).
      TypeError: ``job()`` does not return a dict.
    """
    from jaxpod.client.jobs import SUBMIT_KEYWORDS

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"jaxpod submit: {str(path)!r} is not a file. Pass the path of a "
                         "Python file that defines step_fn and submit's keyword arguments "
                         "(or a job() function returning them).")
    file = file.resolve()
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    run_name = "jaxpod_job_" + re.sub(r"\W", "_", file.stem)
    namespace = runpy.run_path(str(file), run_name=run_name)
    known = ("step_fn", *SUBMIT_KEYWORDS)
    if callable(namespace.get("job")):
        kwargs = namespace["job"]()
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"{file}: job() must return a dict of client.submit's keyword "
                            f"arguments (step_fn=..., steps=..., ...). It returned "
                            f"{type(kwargs).__name__}.")
        kwargs = dict(kwargs)
        unknown = sorted(map(str, set(kwargs) - set(known)))
        if unknown:
            raise ValueError(f"{file}: job() returned {unknown}, which client.submit does not "
                             f"take; its keywords are {', '.join(known)}.")
        if "step_fn" not in kwargs:
            raise ValueError(f"{file}: job() returned no step_fn; add "
                             "'step_fn': <your step function> to the dict it returns.")
        return kwargs
    if "step_fn" in namespace:
        return {k: namespace[k] for k in known if k in namespace}
    raise ValueError(
        f"{file} defines neither step_fn nor job(). Define step_fn(state, batch) -> "
        "(state, outputs) and submit's keyword arguments (steps = 100, dataset = [...], "
        "outputs = {'loss': 'MEAN'}, ...) as module-level names, or a function job() "
        "returning them (step_fn included) as a dict.")


def run_submit(args: argparse.Namespace) -> int:
    from jaxpod.client.jobs import SUBMIT_DEFAULTS, build_spec, submit_spec

    kwargs = load_job_file(args.file)
    for flag in ("name", "steps", "accelerator_type", "priority"):
        if getattr(args, flag) is not None:
            kwargs[flag] = getattr(args, flag)
    if isinstance(kwargs.get("accelerator_type"), str) and "," in kwargs["accelerator_type"]:
        kwargs["accelerator_type"] = tuple(t.strip() for t in
                                           kwargs["accelerator_type"].split(","))
    if "steps" not in kwargs:
        raise ValueError(f"{args.file} sets no steps: define steps = N in it (or return it "
                         "from job()), or pass --steps N.")
    step_fn = kwargs.pop("step_fn")
    try:  # everything is checked before the service is asked anything
        spec = build_spec(step_fn, **{**SUBMIT_DEFAULTS, **kwargs})
    except TypeError as e:
        print(f"jaxpod: error: {e}", file=sys.stderr)
        return 2
    with _connect(args) as client:
        job = submit_spec(client, spec)
        print(job.id, flush=True)
        if not args.wait:
            return 0
        try:
            status = job.wait()  # bounded: `submit --wait` follows the job to its end
        except KeyboardInterrupt:
            print(f"\njaxpod: job {job.id} goes on running: `jaxpod job {job.id} --watch` "
                  f"follows it, `jaxpod cancel {job.id}` stops it.", file=sys.stderr)
            return 130
        print(_line(status), flush=True)
        if status.error:
            print(status.error, file=sys.stderr)
        return 0 if status.state == "SUCCEEDED" else 1


# --------------------------------------------------------------- jobs, job, cancel
def run_jobs(args: argparse.Namespace) -> int:
    from jaxpod.jobs import check_state  # not the client's modules: they import JAX

    check_state(args.state)  # before connecting: a typo needs no service to be told
    with _connect(args) as client:
        statuses = client.jobs(args.state)
    _print_listing(
        statuses, args.json, f"No {args.state.upper() + ' ' if args.state else ''}jobs.",
        ("ID", "NAME", "OWNER", "PRIORITY", "STATE", "STEP", "QUEUE", "ACCELERATOR",
         "CREATED", "WAITING FOR"),
        lambda s: (s.id, s.name, s.owner or "-", str(s.priority), s.state,
                   f"{s.step}/{s.steps}",
                   "-" if s.queue_position is None else str(s.queue_position),
                   s.accelerator_type or "-", _time(s.created_at), s.wait_reason or ""))
    return 0


def run_audit(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        records = client.audit(args.limit)
    _print_listing(records, args.json, "The audit log is empty.",
                   ("SEQ", "AT", "WHO", "ACTION", "TARGET", "DETAIL"),
                   lambda r: (str(r.seq), _time(r.at), r.who, r.action, r.target, r.detail))
    return 0


def _print_listing(items: Sequence[Any], as_json: bool, empty: str, header: Sequence[str],
                   row: Callable[[Any], Sequence[str]]) -> None:
    """Records as a JSON list, or as a table of ``header`` and ``row(item)`` (on
    stderr, ``empty`` when there are none)."""
    if as_json:
        print(json.dumps([dataclasses.asdict(item) for item in items], indent=1))
    elif not items:
        print(empty, file=sys.stderr)
    else:
        _print_rows([header, *(row(item) for item in items)])


def _print_rows(rows: Sequence[Sequence[str]]) -> None:
    """A table: columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def run_job(args: argparse.Namespace) -> int:
    if args.host is not None and args.stacks_of is None:
        print("jaxpod job: --host goes with `jaxpod job stacks ID`.", file=sys.stderr)
        return 2
    if args.stacks_of is not None:
        if args.job_id != "stacks" or args.watch or args.json:
            print(f"jaxpod job: got {args.job_id!r} and {args.stacks_of!r}"
                  f"{' with --watch/--json' if args.watch or args.json else ''}; expected "
                  "`jaxpod job ID [--watch] [--json]` or `jaxpod job stacks ID [--host N]`.",
                  file=sys.stderr)
            return 2
        return run_stacks(args.stacks_of, args)
    with _connect(args) as client:
        job = client.job(args.job_id)
        if not args.watch:
            _print_details(job.details(), args.json)
            return 0
        try:
            last = None
            printed = 0.0
            for status in job.watch():
                # A line per state change, and per step change at most once a second.
                if (last is None or status.state != last.state or status.done
                        or time.monotonic() - printed >= 1.0):
                    print(json.dumps(dataclasses.asdict(status)) if args.json
                          else _line(status), flush=True)
                    printed = time.monotonic()
                last = status
        except KeyboardInterrupt:
            return 130
        if last is not None and last.error and not args.json:
            print(last.error, file=sys.stderr)
    return 0


def run_stacks(job_id: str, args: argparse.Namespace) -> int:
    """``jaxpod job stacks ID [--host N]``: every host's Python stacks (or host N's),
    host by host."""
    with _connect(args) as client:
        hosts = client.job(job_id).stacks()
    if args.host is not None:
        if not 0 <= args.host < len(hosts):
            print(f"jaxpod job stacks: --host {args.host} is not a host of job {job_id}'s "
                  f"running attempt; it has hosts 0-{len(hosts) - 1}.", file=sys.stderr)
            return 2
        hosts = [hosts[args.host]]
    for h in hosts:
        print(f"== host {h.host}  {h.node}  pid {h.pid}")
        print(h.stacks)
    return 0


def run_logs(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        try:
            for line in client.job(args.job_id).log_lines(args.host, args.follow):
                print(line, flush=args.follow)
        except KeyboardInterrupt:
            return 130
    return 0


#: How long `jaxpod cancel` waits for a running job to stop before printing its state.
CANCEL_WAIT_S = 30.0


def run_cancel(args: argparse.Namespace) -> int:
    from jaxpod.errors import DeadlineExceededError

    with _connect(args) as client:
        job = client.job(args.job_id)
        status = job.cancel()
        if not status.done:  # the service answers at once; the job stops at its next loop
            try:
                status = job.wait(CANCEL_WAIT_S, progress=False)
            except DeadlineExceededError:
                status = job.status()
    print(f"{status.id}: {status.state}")
    return 0


def run_fork(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("name", args.name), ("priority", args.priority))
                 if v is not None}
    with _connect(args) as client:
        job = client.fork(args.job_id, step=args.step, steps=args.steps, **overrides)
    print(job.id)
    return 0


def run_suspend(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        job = client.job(args.job_id)
        status = job.resume() if args.resume else job.suspend()
    print(f"{status.id}: {status.state}")
    return 0


def run_pin(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        status = client.job(args.job_id).pin(args.pinned)
    print(f"{status.id}: {'pinned' if status.pinned else 'not pinned'}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        print(f"jaxpod: tracing job {args.job_id} for {args.seconds:g} s from its next loop "
              "boundary...", file=sys.stderr)
        profile = client.job(args.job_id).profile(args.seconds)
    if args.json:
        print(json.dumps(dataclasses.asdict(profile), indent=1))
        return 0
    print(f"jaxpod: {len(profile.files)} trace file(s), {profile.seconds:g} s per host",
          file=sys.stderr)
    print(profile.path)
    return 0


def _print_details(details: JobDetails, as_json: bool) -> None:
    status = details.status
    if as_json:  # the status's fields at the top, then the rest
        rest = dataclasses.asdict(details)
        print(json.dumps({**rest.pop("status"), **rest}, indent=1))
        return
    fields = [
        ("id", status.id), ("name", status.name), ("owner", status.owner or "-"),
        ("team", status.team), ("priority", str(status.priority)),
        ("state", status.state),
        ("step", f"{status.step}/{status.steps}"),
        ("rate", "-" if status.steps_per_s is None else f"{status.steps_per_s:.4g} steps/s"),
        ("attempts", str(status.attempts)),
        ("queue position", "-" if status.queue_position is None else str(status.queue_position)),
        *([("waiting", status.wait_reason)] if status.wait_reason else []),
        ("accelerator", status.accelerator_type or "-"),
        ("created", _time(status.created_at)), ("started", _time(status.started_at)),
        ("finished", _time(status.finished_at)),
        ("metrics", _metrics(status.metrics) or "-"),
        *([("kept", "pinned (retention never prunes it)")] if status.pinned else []),
        *([("kept", f"a summary since {_time(status.pruned_at)} (pruned by retention: "
                    "logs, result and checkpoints deleted)")]
          if status.pruned_at is not None else []),
    ]
    for key, value in fields:
        print(f"{key + ':':<16}{value}")
    if status.goodput:
        print(_goodput(status.goodput))
    if details.history:
        print("history:")
        for t in details.history:
            print(f"  {_time(t.at)}  {t.from_state or '(submitted)'} -> {t.to_state}"
                  + (f"  {t.reason.splitlines()[0]}" if t.reason else ""))
    if details.attempts:
        print("attempts:")
        for a in details.attempts:
            end = (f"ended {_time(a.ended_at)} ({a.cause}, step {a.step_reached})"
                   if a.ended_at else "running")
            programs = ("" if a.programs_compiled is None else
                        f"; programs: {a.programs_loaded} from the compilation cache, "
                        f"{a.programs_compiled} compiled")
            on = f" on {a.accelerator_type}" if a.accelerator_type else ""
            print(f"  #{a.number}{on}  started {_time(a.started_at)}, {end}{programs}")
    if details.checkpoints:
        print("checkpoints:")
        for c in details.checkpoints:
            stall = "" if c.stall_s is None else f"  steps waited {c.stall_s:.3g} s"
            print(f"  step {c.step}  {_time(c.saved_at)}  {c.path}{stall}")
    if details.profiles:
        print("profiles:")
        for p in details.profiles:
            print(f"  {_time(p.started_at)}  {p.seconds:g} s  {len(p.files)} trace file(s)  "
                  f"{p.path}")
    if details.hosts:
        print("hosts of the running attempt (input per host):")
        for h in details.hosts:
            print(f"  host {h.host}  {h.node} {h.address} pid {h.pid}  "
                  f"{h.step_s:.3g} s/step  "
                  f"waited {h.input_wait_s:.3f} s  {h.input_queue_depth} chunk(s) ready"
                  + (f"  STRAGGLER: {h.straggler}" if h.straggler else ""))
        if any(h.straggler for h in details.hosts):
            print(f"  (`jaxpod job stacks {status.id}` shows what each host is doing)")
    if status.error:
        print("error:")
        for line in status.error.splitlines():
            print(f"  {line}")


def _line(status: JobStatus) -> str:
    """One line per change: time, id, state, step, queue position and metrics."""
    parts = [time.strftime("%H:%M:%S"), status.id, status.state,
             f"step {status.step}/{status.steps}"]
    if status.queue_position is not None:
        parts.append(f"queue #{status.queue_position}")
    if status.metrics:
        parts.append(_metrics(status.metrics))
    if status.stragglers:
        parts.append("straggler(s): " + ", ".join(f"host {h}" for h in status.stragglers))
    return "  ".join(parts)


def _goodput(goodput: Mapping[str, float]) -> str:
    """The goodput section of ``jaxpod job ID``: the productive share of the wall time,
    then each category that took time, largest first, with its share."""
    seconds = {k: v for k, v in goodput.items() if k not in ("wall_s", "productive_share")}
    wall = goodput.get("wall_s", sum(seconds.values()))
    share = goodput.get("productive_share", seconds.get("productive", 0.0) / wall
                        if wall > 0 else 0.0)
    lines = [f"{'goodput:':<16}{share:.1%} productive of {wall:.3f} s wall time"]
    for name, value in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])):
        if value > 0 or name == "productive":
            lines.append(f"  {name:<14}{value:>12.3f} s  "
                         f"{value / wall if wall > 0 else 0.0:>6.1%}")
    return "\n".join(lines)


def _metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))


def _time(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
