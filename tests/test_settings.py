"""Every ``JAXPOD_*`` setting declared once (jaxpod/settings.py): values from the
default or the environment, refusals that say what to fix, typos caught where a process
starts, ``jaxpod config`` in a fresh interpreter, the generated reference page, and no
read of a ``JAXPOD_`` variable anywhere else."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpod import settings
from jaxpod.settings import SettingError

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("jaxpod", "worker", "service", "client", "proto")


def test_a_setting_comes_from_its_default_the_environment_or_the_call() -> None:
    setting = settings.ASYNC_WINDOW
    assert setting.get({}) == 64 and setting.source({}) == "default"
    assert setting.get({setting.name: " 3 "}) == 3
    assert setting.source({setting.name: "3"}) == "environment"
    assert setting.get({setting.name: "  "}) == 64  # blank is unset
    assert setting.value(5) == 5  # the call's own beats the environment
    assert settings.OPERATION_TIMEOUT.seconds({"JAXPOD_OPERATION_TIMEOUT_S": "2.5"}) == 2.5
    assert settings.OPERATION_TIMEOUT.resolve(7) == 7.0
    assert settings.CHANNEL_LEND.get({"JAXPOD_CHANNEL_LEND": "0"}) is False
    assert settings.LOCAL_PROVIDER.get({"JAXPOD_LOCAL_PROVIDER": "processes"}) == "processes"
    assert settings.COORDINATOR_PORT.get({"JAXPOD_COORDINATOR_PORT": "8482"}) == 8482


def test_a_hot_path_reparses_only_new_text(monkeypatch: pytest.MonkeyPatch) -> None:
    setting = settings.PIPELINE_DEPTH
    parsed: list[str] = []
    parse = settings.Setting.parse

    def counting(self: settings.Setting, raw: str) -> object:
        parsed.append(raw)
        return parse(self, raw)

    monkeypatch.setattr(settings.Setting, "parse", counting)
    monkeypatch.setenv(setting.name, "5")
    assert [setting.value() for _ in range(1000)] == [5] * 1000
    monkeypatch.setenv(setting.name, "6")
    assert setting.value() == 6
    assert parsed == ["5", "6"]


@pytest.mark.parametrize(("setting", "bad", "expected"), [
    (settings.OPERATION_TIMEOUT, "soon", "a positive number of seconds"),
    (settings.OPERATION_TIMEOUT, "-1", "a positive number of seconds"),
    (settings.ASYNC_WINDOW, "1.5", "a positive int"),
    (settings.ASYNC_WINDOW, "0", "a positive int"),
    (settings.RESULT_BLOCK_BYTES, "4MB", "a positive int of bytes"),
    (settings.ASYNC_DISPATCH, "maybe", "0 or 1"),
    (settings.LOCAL_PROVIDER, "docker", "one of ray, processes"),
    (settings.COORDINATOR_PORT, "70000", r"a TCP port \(1-65535\)"),
])
def test_a_value_that_does_not_parse_names_the_variable_the_value_and_the_fix(
        setting: settings.Setting, bad: str, expected: str) -> None:
    with pytest.raises(SettingError, match=(
            rf"^{setting.name}='{re.escape(bad)}' is not valid: expected {expected} "
            rf"\(default {re.escape(setting.default_text())}\)\. Fix: set e\.g\. "
            rf"{setting.name}=.*, or unset it\.")):
        setting.get({setting.name: bad})


def test_a_typo_is_caught_naming_the_closest_setting() -> None:
    with pytest.raises(SettingError, match=(
            r"JAXPOD_OPERATON_TIMEOUT_S is set, but jaxpod has no setting of that name.*"
            r"Did you mean JAXPOD_OPERATION_TIMEOUT_S")):
        settings.check_environment({"JAXPOD_OPERATON_TIMEOUT_S": "5"})
    with pytest.raises(SettingError, match="jaxpod config` lists every setting"):
        settings.check_environment({"JAXPOD_WHATEVER": "1"})
    with pytest.raises(SettingError, match="JAXPOD_SESSION_LEASE_S='x'"):
        settings.check_environment({"JAXPOD_SESSION_LEASE_S": "x"})
    settings.check_environment({"JAXPOD_SESSION_LEASE_S": "3", "OTHER": "x"})


def _fresh(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOD_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_jaxpod_config_lists_every_setting_with_its_value_and_source() -> None:
    run = _fresh("from jaxpod.cli import main; raise SystemExit(main(['config', '--json']))",
                 {"JAXPOD_SESSION_LEASE_S": "12", "JAXPOD_TOKEN": "s3cret"})
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in json.loads(run.stdout)}
    assert set(rows) == set(settings.SETTINGS)
    assert rows["JAXPOD_SESSION_LEASE_S"] == {"name": "JAXPOD_SESSION_LEASE_S", "value": "12",
                                              "source": "environment", "part": "service"}
    assert rows["JAXPOD_OPERATION_TIMEOUT_S"]["source"] == "default"
    assert rows["JAXPOD_TOKEN"]["value"] == "(set)"  # a secret is never printed
    assert "s3cret" not in run.stdout


def test_jaxpod_config_into_a_reader_that_left_says_nothing_more() -> None:
    """``jaxpod config | head``: the reader may be gone before the table is written."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOD_")}
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "jaxpod.cli", "config"], env=clean,
                             stdout=write_end, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    finally:
        os.close(write_end)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_a_typo_stops_the_cli_and_connect_before_anything_starts() -> None:
    run = _fresh("from jaxpod.cli import main; raise SystemExit(main(['config']))",
                 {"JAXPOD_ADRESS": "127.0.0.1:1"})
    assert run.returncode == 2
    assert "Did you mean JAXPOD_ADDRESS?" in run.stderr, run.stderr
    # A misspelt address would otherwise start the embedded service instead.
    run = _fresh("import sys\n"
                 "import jaxpod\n"
                 "from jaxpod.settings import SettingError\n"
                 "try:\n"
                 "    jaxpod.connect()\n"
                 "except SettingError as e:\n"
                 "    assert isinstance(e, jaxpod.JaxpodError)\n"
                 "    print('REFUSED', e)\n"
                 "embedded = sys.modules.get('jaxpod.client.embedded')\n"
                 "assert embedded is None or not embedded._shared, 'a service started'\n",
                 {"JAXPOD_ADRESS": "127.0.0.1:1"})
    assert run.returncode == 0, run.stderr
    assert "REFUSED JAXPOD_ADRESS is set" in run.stdout


def test_the_configuration_page_is_generated_from_the_declarations() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == settings.reference(), (
        "docs/configuration.md is out of date with jaxpod/settings.py; regenerate it with "
        "`python -m jaxpod.settings` and commit the result.")
    for name in settings.SETTINGS:
        assert f"`{name}`" in page


def test_no_part_reads_a_jaxpod_variable_but_the_settings_module() -> None:
    """A ``JAXPOD_*`` name written out as a string anywhere but jaxpod/settings.py is a
    read (or a declaration) outside it; the one protocol word is not a variable."""
    allowed = {"JAXPOD_LISTENING"}  # the service's announcement line, never an env var
    found = []
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            if path == ROOT / "jaxpod" / "settings.py" or path.name.endswith("_pb2.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"JAXPOD_[A-Z0-9_]+", node.value) and \
                        node.value not in allowed:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not found, found
