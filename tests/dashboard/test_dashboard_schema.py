"""schemathesis against the committed ``service/http/openapi.json``: requests generated from
the document, sent to a real ``jaxpod serve --local`` with a job in its store; no
answer may be a 5xx or break the document's schema."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serve_process import Service

from jaxpod.service.http.app import OPENAPI_PATH

pytestmark = pytest.mark.multiprocess

schema = schemathesis.openapi.from_path(OPENAPI_PATH)
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance,
          content_type_conformance]


#: One test per operation, each with an id of its own (schemathesis's ``parametrize``
#: gives all of them one node id, and pytest-xdist runs one test per node id).
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
def test_no_server_error_and_every_answer_fits_the_schema(operation: Any, service: Service,
                                                          finished_job: str) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def answers_fit(case: Any) -> None:
        case.call_and_validate(base_url=service.http_url, checks=CHECKS, timeout=60,
                               headers={"Authorization": f"Bearer {service.token}"})

    answers_fit()


@pytest.fixture(scope="module")
def finished_job(client: Any) -> str:
    """A job in the store, so listings and the metrics have one to show."""
    from dashboard_jobs import submit

    job = submit(client, steps=4, steps_per_run=2, name="schema")
    assert job.wait(timeout=120).state == "SUCCEEDED"
    return str(job.id)
