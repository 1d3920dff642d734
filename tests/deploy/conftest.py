"""The deploy tests share the service suites' helpers (certificates, ``jaxpod serve``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))
