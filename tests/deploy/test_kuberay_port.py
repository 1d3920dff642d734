"""The play's port of KubeRay's ``ray start`` builder gives what KubeRay's own tests
expect (``ray-operator/controllers/ray/common/pod_test.go``,
``TestGenerateRayStartCommand``, at the CRD's commit), so the local play starts what a
cluster would."""

from __future__ import annotations

import pytest
from kuberay_play import generate_ray_start_command, ray_start_command

CASES = [
    (False, {}, {"nvidia.com/gpu": "1"}, "ray start  --num-gpus=1 "),
    (False, {}, {"nvidia.com/mig-2g.32gb": "1"}, "ray start  --num-gpus=1 "),
    (False, {}, {"google.com/tpu": "4"}, """ray start  --resources='{"TPU":4}' """),
    (True, {}, {"aws.amazon.com/neuroncore": "4", "nvidia.com/gpu": "1"},
     """ray start --head  --num-gpus=1  --resources='{"neuron_cores":4}' """),
    (True, {}, {"google.com/tpu": "8", "aws.amazon.com/neuroncore": "4", "nvidia.com/gpu": "1"},
     """ray start --head  --num-gpus=1  --resources='{"neuron_cores":4}' """),
    (True, {"resources": '"{"custom_resource":2}"'}, {"aws.amazon.com/neuroncore": "4"},
     """ray start --head  --resources='{"custom_resource":2,"neuron_cores":4}' """),
    (True, {"resources": """'{"custom_resource":2,"TPU":4}'"""}, {"google.com/tpu": "8"},
     """ray start --head  --resources='{"custom_resource":2,"TPU":4}' """),
    (True, {"resources": "{"}, {"aws.amazon.com/neuroncore": "4"},
     "ray start --head  --resources={ "),
    (True, {"include-log-monitor": "false"}, {}, "ray start --head  --include-log-monitor=false "),
]


@pytest.mark.parametrize(("head", "params", "limits", "expected"), CASES)
def test_generate_ray_start_command(head: bool, params: dict[str, str],
                                    limits: dict[str, str], expected: str) -> None:
    assert generate_ray_start_command(head, params, {"limits": limits}) == expected


def test_a_tpu_worker_pod_command() -> None:
    resources = {"limits": {"cpu": "8", "memory": "32Gi", "google.com/tpu": "4"},
                 "requests": {"cpu": "8", "memory": "32Gi", "google.com/tpu": "4"}}
    fqdn = "jaxpod-head-svc.jaxpod.svc.cluster.local"
    assert ray_start_command(False, {}, resources, fqdn, "6379") == (
        "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start "
        " --address=jaxpod-head-svc.jaxpod.svc.cluster.local:6379  --block "
        " --dashboard-agent-listen-port=52365  --memory=34359738368 "
        " --metrics-export-port=8080  --num-cpus=8  --resources='{\"TPU\":4}' ")
