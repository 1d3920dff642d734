"""GCE: a TPU VM learns its slice from the instance metadata server.

Attributes read (under ``computeMetadata/v1/instance/attributes/``):
``accelerator-type`` (``v4-16``), ``agent-worker-number`` (this host's worker id),
``worker-network-endpoints`` (the slice's hosts, either ``host,host`` or
``name:id:ip,name:id:ip``), ``tpu-env`` (lines ``KEY: 'value'`` with ``TOPOLOGY``,
``NODE_ID``, ``CHIPS_PER_HOST_BOUNDS`` and, for multi-slice, ``MEGASCALE_*``) and
``instance-id`` (the slice name when ``tpu-env`` has no ``NODE_ID``).

HTTP goes through an injectable getter; the default one talks to
``$GCE_METADATA_IP`` (the variable JAX honours too) or ``metadata.google.internal``.
"""

from __future__ import annotations

import glob
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from jaxpod import settings
from jaxpod.service.capacity.resolvers._tpu_vm import Setting, TpuVmSettings, resolve_tpu_vm
from jaxpod.service.capacity.resolvers.base import ClusterInfo

#: Returns the text of one metadata attribute, or ``None`` when it does not exist.
MetadataGetter = Callable[[str], "str | None"]

METADATA_HOST_VAR = "GCE_METADATA_IP"
DEFAULT_METADATA_HOST = "metadata.google.internal"
ATTRIBUTES_PATH = "/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT = settings.GCE_METADATA_TIMEOUT

_TPU_ENV_LINE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*:\s*(.*?)\s*$")
_DMI_PRODUCT = Path("/sys/class/dmi/id/product_name")


class HttpMetadataGetter:
    """Reads metadata attributes over HTTP with the ``Metadata-Flavor`` header."""

    def __init__(self, host: str, timeout_s: float | None = None) -> None:
        """Args:
        host: ``host[:port]`` of the metadata server.
        timeout_s: per-request time-out; ``JAXPOD_GCE_METADATA_TIMEOUT_S`` when ``None``.
        """
        self.base_url = f"http://{host}{ATTRIBUTES_PATH}"
        self._timeout_s = METADATA_TIMEOUT.resolve(timeout_s)
        # The metadata server is always reached directly, never through a proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self, key: str) -> str | None:
        """The attribute's text, or ``None`` on HTTP 404.

        Raises:
          ConnectionError: the server is unreachable, times out or answers with
            another error status; the message names the URL and the time-out knob.
        """
        url = self.base_url + key
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        try:
            with self._opener.open(request, timeout=self._timeout_s) as response:
                return str(response.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise ConnectionError(
                f"GCE metadata server answered HTTP {e.code} for {url}. Expected 200 or "
                "404. Check that this is a Cloud TPU VM and that "
                f"{METADATA_HOST_VAR} (if set) points at the metadata server."
            ) from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ConnectionError(
                f"Could not read {url} within {self._timeout_s:g} s "
                f"({METADATA_TIMEOUT.env_var}): {e}. This is not a GCE TPU VM, or "
                f"{METADATA_HOST_VAR} points at the wrong host."
            ) from e


class GceResolver:
    """Resolves this TPU VM's slice from the GCE metadata server."""

    environment = "gce"

    def __init__(
        self,
        getter: MetadataGetter | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        getter: fetches one attribute; when ``None``, an :class:`HttpMetadataGetter`
          for ``$GCE_METADATA_IP`` or ``metadata.google.internal``.
        environ: where ``GCE_METADATA_IP`` is looked up (``os.environ`` when ``None``).
        """
        self._environ = os.environ if environ is None else environ
        self._getter = getter

    @property
    def getter(self) -> MetadataGetter:
        """The attribute getter in use (created on first use: it may never be needed)."""
        if self._getter is None:
            host = self._environ.get(METADATA_HOST_VAR) or DEFAULT_METADATA_HOST
            self._getter = HttpMetadataGetter(host)
        return self._getter

    def is_present(self) -> bool:
        """``GCE_METADATA_IP`` is set, or this is a GCE VM with TPU devices (no network)."""
        if self._environ.get(METADATA_HOST_VAR):
            return True
        return _on_gce() and _has_tpu_devices()

    def resolve(self) -> ClusterInfo:
        """Reads the metadata attributes into this host's slice.

        Raises:
          ValueError: a missing or malformed attribute, named in the message.
          ConnectionError: the metadata server could not be read.
        """
        get = self.getter
        tpu_env = parse_tpu_env(get("tpu-env") or "")

        def attr(key: str) -> Setting:
            return Setting(f"GCE metadata attribute {key!r}", get(key))

        def env(key: str) -> Setting:
            return Setting(f"GCE metadata tpu-env {key}", tpu_env.get(key))

        name = env("NODE_ID")
        if not name.value:
            name = attr("instance-id")
        settings = TpuVmSettings(
            accelerator_type=attr("accelerator-type"),
            topology=env("TOPOLOGY"),
            chips_per_host_bounds=env("CHIPS_PER_HOST_BOUNDS"),
            worker_id=attr("agent-worker-number"),
            hostnames=_endpoints(attr("worker-network-endpoints")),
            name=name,
            megascale_num_slices=env("MEGASCALE_NUM_SLICES"),
            megascale_slice_id=env("MEGASCALE_SLICE_ID"),
            megascale_coordinator=env("MEGASCALE_COORDINATOR_ADDRESS"),
            megascale_port=env("MEGASCALE_PORT"),
        )
        source = f"GCE metadata at {getattr(get, 'base_url', 'an injected getter')}"
        return resolve_tpu_vm(settings, environment=self.environment, source=source)


def parse_tpu_env(text: str) -> dict[str, str]:
    """Parses the ``tpu-env`` attribute: one ``KEY: 'value'`` per line.

    Returns:
      The keys and their unquoted values; lines without ``:`` are skipped.
    """
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _TPU_ENV_LINE.match(line)
        if match:
            values[match[1]] = match[2].strip("'\"")
    return values


def _endpoints(raw: Setting) -> Setting:
    """Normalises ``worker-network-endpoints`` to a plain ``host,host`` list.

    Each entry is either a host name or a ``name:id:ip`` triple (older format), as
    JAX's own GCE detection reads it.
    """
    if raw.value is None:
        return raw
    hosts = []
    for index, entry in enumerate(raw.value.strip().split(",")):
        parts = entry.split(":")
        if len(parts) not in (1, 3):
            raise ValueError(
                f"{raw.source}={raw.value!r} is malformed: entry {index} ({entry!r}) is "
                "neither 'host' nor 'name:id:ip'."
            )
        hosts.append(parts[-1])
    return Setting(raw.source, ",".join(hosts))


def _on_gce() -> bool:
    try:
        return "Google" in _DMI_PRODUCT.read_text()
    except OSError:
        return False


def _has_tpu_devices() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
