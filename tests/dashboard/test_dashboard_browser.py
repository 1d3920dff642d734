"""The status page in a real browser: headless Chromium (Debian's ``chromium``, driven
by Playwright with ``executable_path``) signs in, loads ``/`` while a job runs on the
simulated cluster, and sees the job's row go from RUNNING to SUCCEEDED, its loss chart
gain points and its last checkpoint shown, without a reload. A screenshot is left in
``tests/artifacts/``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dashboard_jobs import ARTIFACTS, submit
from playwright.sync_api import Browser, expect, sync_playwright
from serve_process import Service, chromium_path

from jaxpod.timeouts import wait_for

pytestmark = pytest.mark.multiprocess

STEPS, STEPS_PER_RUN = 100, 2  # paced: >= 5 s of running, a loss point every loop


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield launched
        finally:
            launched.close()


def test_the_page_follows_a_running_job_to_the_end(service: Service, client: Any,
                                                   browser: Browser) -> None:
    job = submit(client, steps=STEPS, steps_per_run=STEPS_PER_RUN, paced=True,
                 name="in-browser")
    assert wait_for(lambda: job.status().state == "RUNNING", 120), job.status()
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    try:
        page.goto(service.http_url + "/")  # not signed in: sent to the form
        assert page.url.endswith("/login")
        page.fill("input[name=token]", service.token)
        page.click("button[type=submit]")
        page.wait_for_url(service.http_url + "/")

        row = page.locator(f'#jobs tr[data-job-id="{job.id}"]')
        state = row.locator("td.state")
        chart = page.locator("#chart-loss")
        assert page.locator("body").get_attribute("data-job") == job.id
        seen_running = state.inner_text() == "RUNNING"
        expect(chart).not_to_have_attribute("data-points", "0", timeout=60_000)
        first = int(chart.get_attribute("data-points") or 0)
        # The v4-8's one host, where its worker runs and its input feed, read while the
        # job runs.
        expect(page.locator("#hosts tbody tr")).to_have_count(1, timeout=30_000)
        cells = page.locator("#hosts tbody tr td").all_inner_texts()
        assert cells[0] == "0" and cells[1] and cells[2], cells
        assert cells[3].isdigit() and int(cells[3]) > 0, cells  # its worker's pid
        assert seen_running or job.status().state == "RUNNING", (
            "the job finished before the page showed it running; make it longer")
        expect(state).to_have_text("SUCCEEDED", timeout=120_000)
        expect(page.locator("#detail-state")).to_have_text("SUCCEEDED", timeout=30_000)
        last_checkpoint = job.checkpoints()[-1]  # the final state's
        assert last_checkpoint.step == STEPS
        expect(page.locator("#detail-checkpoint")).to_contain_text(
            f"last checkpoint: step {STEPS}, ", timeout=30_000)
        expect(page.locator("#detail-checkpoint")).to_contain_text(last_checkpoint.path)
        expect(chart).to_have_attribute("data-points", str(STEPS // STEPS_PER_RUN),
                                        timeout=30_000)
        assert first < STEPS // STEPS_PER_RUN, "the chart gained no point while watched"
        assert int(page.locator("#chart-rate").get_attribute("data-points") or 0) >= 1
        assert page.locator("#chart-loss polyline").count() == 1
        assert page.locator(".slice .chip").count() == 4  # the v4-8's host and chips
        # Pin and unpin from the page: the service records it, the page says so.
        pin, kept = page.locator("#pin-job"), page.locator("#detail-kept")
        expect(pin).to_have_text("Pin")
        pin.click()
        expect(kept).to_contain_text("pinned: retention never prunes it", timeout=30_000)
        expect(pin).to_have_text("Unpin")
        assert job.status().pinned
        pin.click()
        expect(kept).to_be_hidden(timeout=30_000)
        assert not job.status().pinned
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    finally:
        context.close()
