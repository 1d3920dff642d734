"""One real ``jaxpod serve --local`` for every dashboard test (started once: the suite
must stay fast), with its own state dir, a token and ``--http-port 0``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))

from serve_process import Service, start_service, stop_service

SLICES = "v4-8"


@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    where = tmp_path_factory.mktemp("dashboard")
    started = start_service(where / "service.log", SLICES,
                            args=("--state-dir", str(where / "state")))
    try:
        yield started
    finally:
        stop_service(started)


@pytest.fixture(scope="package")
def client(service: Service) -> Iterator[Any]:
    with service.connect() as connected:
        yield connected
