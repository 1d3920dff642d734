"""``OutputCapture``: keeps what this process prints on stdout and stderr, as lines.

A job's code prints on its host workers: ``print`` while a step function is traced,
``jax.debug.print`` while it runs (a host callback, often on another thread; it writes
to ``sys.stdout``). While capturing, ``sys.stdout`` and ``sys.stderr`` are tees that
still write through to the streams they replaced (so Ray's worker logs keep the text)
and hand the text to one bounded buffer of lines, taken by :meth:`OutputCapture.take`.

Not captured: text written below Python's ``sys`` streams (``os.write(1, ...)``, C++
logging such as XLA's or gloo's, writes to ``sys.stdout.buffer``), and ``logging``
handlers made before capture started (each holds the stream it was given).
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, TextIO, cast

#: Lines kept between takes; beyond it (or ``MAX_CHARS``) the oldest are dropped.
MAX_LINES = 10_000
MAX_CHARS = 4 * 1024 * 1024
#: A line that grows past this is cut here, so a line that never ends stays bounded.
MAX_LINE_CHARS = 64 * 1024
#: Unfinished lines kept at once (one per stream and thread that wrote part of one).
MAX_PARTIAL = 256


class _Tee:
    """A replacement for ``sys.stdout`` or ``sys.stderr``: writes through to the
    original stream and hands the text to the capture while it is attached.
    Anything else (``fileno``, ``encoding``, ``isatty``, ``buffer``) is the original's."""

    def __init__(self, original: TextIO | None, name: str, capture: OutputCapture) -> None:
        self._original = original
        self._name = name
        # Cleared when capture stops: a tee that someone else still holds (and may put
        # back as sys.stdout later) then only writes through.
        self._capture: OutputCapture | None = capture

    def write(self, text: str) -> int:
        if self._original is not None:
            self._original.write(text)  # first: what it rejects is not captured either
        capture = self._capture
        if capture is not None:
            capture._feed(self, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._original is not None:
            self._original.flush()

    def __getattr__(self, name: str) -> Any:
        if name == "_original":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._original, name)

    def __repr__(self) -> str:
        return f"<jaxpod output tee of {self._name}: {self._original!r}>"


class OutputCapture:
    """Captures this process's ``sys.stdout`` and ``sys.stderr`` as lines, in order.

    Thread-safe. Each thread's text on each stream is split into lines separately, so
    threads printing at once do not cut into each other's lines.
    """

    def __init__(self, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS,
                 max_line_chars: int = MAX_LINE_CHARS) -> None:
        if not 0 < max_line_chars <= max_chars:
            raise ValueError("OutputCapture: need 0 < max_line_chars <= max_chars.")
        self._max_lines = max_lines
        self._max_chars = max_chars
        self._max_line_chars = max_line_chars
        # Reentrant: a finalizer or signal handler that prints may run while this
        # thread holds it (a garbage collection inside the locked code).
        self._lock = threading.RLock()
        self._lines: collections.deque[str] = collections.deque()
        self._chars = 0
        self._dropped = 0
        # (tee, thread id) -> the unfinished line it wrote; insertion order is age.
        self._partial: dict[tuple[_Tee, int], str] = {}
        self._tees: tuple[_Tee, _Tee] | None = None
        self._originals: tuple[TextIO, TextIO] | None = None

    @property
    def capturing(self) -> bool:
        return self._tees is not None

    def start(self) -> None:
        """Replaces ``sys.stdout`` and ``sys.stderr`` by tees; already capturing: no-op."""
        with self._lock:
            if self._tees is not None:
                return
            self._originals = (sys.stdout, sys.stderr)
            self._tees = (_Tee(sys.stdout, "stdout", self), _Tee(sys.stderr, "stderr", self))
            sys.stdout, sys.stderr = cast(TextIO, self._tees[0]), cast(TextIO, self._tees[1])

    def stop(self) -> None:
        """Puts the original streams back; unfinished lines are kept as lines."""
        with self._lock:
            if self._tees is None or self._originals is None:
                return
            for key in list(self._partial):
                self._append(self._partial.pop(key))
            out, err = self._tees
            out._capture = err._capture = None
            # Only where they are still ours: someone who replaced them meanwhile
            # (redirect_stdout, a test's capture) puts back their own later.
            if sys.stdout is out:
                sys.stdout = self._originals[0]
            if sys.stderr is err:
                sys.stderr = self._originals[1]
            self._tees = self._originals = None

    def take(self) -> list[str]:
        """The complete lines captured since the last take, oldest first; when some
        were dropped to stay in bounds, a first line says how many."""
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
            self._chars = 0
            if self._dropped:
                lines.insert(0, f"[jaxpod: {self._dropped} earlier lines of output dropped "
                                f"(at most {self._max_lines} lines or {self._max_chars} "
                                "characters are kept between reads)]")
                self._dropped = 0
            return lines

    def discard(self) -> None:
        """Stops capturing and forgets everything captured."""
        self.stop()
        with self._lock:
            self._lines.clear()
            self._chars = self._dropped = 0

    # ------------------------------------------------------------------ helpers
    def _feed(self, tee: _Tee, text: str) -> None:
        key = (tee, threading.get_ident())
        with self._lock:
            if tee._capture is not self:  # capture stopped after the tee read it
                return
            *complete, rest = (self._partial.pop(key, "") + text).split("\n")
            for line in complete:
                self._append(line)
            if len(rest) > self._max_line_chars:  # a line that never ends stays bounded
                cut = len(rest) - len(rest) % self._max_line_chars
                self._append(rest[:cut])
                rest = rest[cut:]
            if rest:
                self._partial[key] = rest
                if len(self._partial) > MAX_PARTIAL:  # threads that died mid-line
                    self._append(self._partial.pop(next(iter(self._partial))))

    def _append(self, line: str) -> None:
        """Keeps ``line`` (cut into pieces if too long), dropping the oldest to fit."""
        for start in range(0, max(len(line), 1), self._max_line_chars):
            piece = line[start:start + self._max_line_chars]
            self._lines.append(piece)
            self._chars += len(piece)
            while len(self._lines) > self._max_lines or self._chars > self._max_chars:
                self._chars -= len(self._lines.popleft())
                self._dropped += 1
