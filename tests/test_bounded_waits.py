"""Every blocking wait in the package is bounded (issue 54: no wait that cannot end well).

A call that waits on another thread or process (``wait``, ``wait_for``, ``join``,
``result``, ``acquire``, ``communicate``) passes a time-out, or says on its line, or
the line above, why it cannot hang: ``# bounded: <why>`` (for example: the process was
just SIGKILLed; the coordinator's operation time-out resets the slice). The scan reads
the source, so a new unbounded wait fails here, named with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpod", "service", "worker", "client", "proto")
WAITS = {"wait", "wait_for", "join", "result", "acquire", "communicate"}
MARK = "# bounded:"


def _bounded(call: ast.Call) -> bool:
    """Whether the call passes a time-out (a ``timeout`` keyword, or a positional one:
    ``event.wait(5)``, ``thread.join(5)``, ``future.result(5)``, ``lock.acquire(True,
    5)``, ``condition.wait_for(predicate, 5)``)."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    if any(k.arg == "timeout" for k in call.keywords):
        return True
    needed = {"wait_for": 2, "acquire": 2}.get(name, 1)
    return len(call.args) >= needed


def unbounded_waits(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``path:line: code`` of each wait without a time-out or a ``# bounded:`` reason."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            source = path.read_text()
            lines = source.splitlines()
            for node in ast.walk(ast.parse(source)):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in WAITS) or _bounded(node):
                    continue
                first, last = node.lineno, node.end_lineno or node.lineno
                said = lines[max(0, first - 2):last]
                if not any(MARK in line for line in said):
                    found.append(f"{path.relative_to(root)}:{first}: {lines[first - 1].strip()}")
    return found


def test_every_wait_has_a_time_out_or_says_why_it_cannot_hang() -> None:
    found = unbounded_waits()
    assert not found, (
        "These calls wait without a time-out. Pass one (from jaxpod.settings, with a "
        f"clear error when it passes), or add `{MARK} <why it cannot hang>` on the "
        "line or the line above:\n" + "\n".join(found))


def test_the_scan_finds_an_unbounded_wait_and_accepts_a_reason(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(event, proc, fut):\n"
        "    event.wait()\n"
        "    proc.wait()  # bounded: SIGKILLed just now\n"
        "    # bounded: done already\n"
        "    fut.result()\n"
        "    fut.result(timeout=1)\n")
    assert unbounded_waits(tmp_path, ("pkg",)) == ["pkg/m.py:2: event.wait()"]
    calls = [ast.parse(code).body[0].value for code in (  # type: ignore[attr-defined]
        "event.wait()", "event.wait(5)", "thread.join(timeout=1)", "cond.wait_for(p)",
        "cond.wait_for(p, 5)", "lock.acquire()", "lock.acquire(True, 1)", "fut.result()")]
    assert [_bounded(c) for c in calls] == [False, True, True, False, True, False, True,
                                            False]
