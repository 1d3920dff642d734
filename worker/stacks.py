"""Every thread's Python stack in this process, as text: what ``jaxpod job stacks``
prints per host and what a job's logs keep when a host straggles or a loop hangs.

Read with ``sys._current_frames`` from a thread of its own (the host worker's control
calls, which a busy operation channel does not block), so it needs no ptrace
permission and no tool installed on the host, unlike py-spy. A thread that holds the
GIL in native code for good cannot be read this way; the caller's time-out says so.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback


def python_stacks() -> str:
    """Each thread's stack, innermost call last, headed by the thread's name and id;
    the reading thread itself is left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = [f"process {os.getpid()}"]
    for ident, frame in sorted(sys._current_frames().items()):
        if ident == me:
            continue
        parts.append(f'thread "{names.get(ident, "?")}" ({ident}), most recent call last:')
        parts.append("".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(parts)
