"""In-memory checkpoints across restarts of a simulated two-host group (4 chips each).

Real processes, as a restarted attempt's hosts are: one group keeps two steps, each
host's shards on its node's folder and a copy on its peer's (a device collective); a
new group plans from what the nodes hold and restores, from its own nodes or, with a
node's folder gone (a replaced node), from the peer's copy sent back. Each host checks
its shards against numpy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from host_group import run_group

from jaxpod.service.jobs.memory_plan import MemoryPlan, plan

PROGRAM = Path(__file__).with_name("memory_host_program.py")
DEADLINE_S = 120


def _group(root: Path, mode: str, kind: str) -> list[dict[str, object]]:
    """Both hosts of one group, new processes; each one's report, in host order."""
    return run_group(PROGRAM, [mode, kind], {"JAXPOD_MEMORY_CHECKPOINT_DIR": str(root),
                                             "TPU_NAME": "sim-memory"}, deadline_s=DEADLINE_S)


def _restored(root: Path, kind: str, sources: list[int]) -> None:
    for host, report in enumerate(_group(root, "restore", kind)):
        assert report["process"] == host and report["step"] == 4, report
        assert report["sources"] == sources, report
        assert report["positions"] == [{"host": h, "step": 4} for h in range(2)], report
        assert report["equal"] == {"h": True, "mask": True, "n": True, "w": True}, report


@pytest.mark.multiprocess
def test_a_mirrored_state_comes_back_from_its_nodes_or_its_peer(tmp_path: Path) -> None:
    """Every replica's copy is the same: each node keeps one, which serves its peer too
    (its peer's set is an alias of it), and nothing is sent at a save."""
    _group(tmp_path, "save", "per_replica")
    for node in (0, 1):  # the newest step only; each node holds its host's and its peer's
        held = sorted(p.relative_to(tmp_path / f"sim-memory-{node}").as_posix()
                      for p in (tmp_path / f"sim-memory-{node}").glob("job-1/*/*"))
        assert held == ["job-1/step-4/host-0", "job-1/step-4/host-1"], held
        own, peers = (tmp_path / f"sim-memory-{node}/job-1/step-4/host-{h}"
                      for h in (node, 1 - node))
        # One whole copy (w float32 16x4, n int32, mask bool 8x5, h bfloat16 x6), once
        # for the node's 4 chips; the peer's set holds its input position alone.
        assert (own / "blocks.bin").stat().st_size == 16 * 4 * 4 + 4 + 8 * 5 + 6 * 2
        assert not (peers / "blocks.bin").exists()
    _restored(tmp_path, "per_replica", [0, 1])
    shutil.rmtree(tmp_path / "sim-memory-1")  # host 1's node was replaced
    _restored(tmp_path, "per_replica", [0, 0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["global", "split"])
def test_a_sharded_state_comes_back_from_the_peers_copy(tmp_path: Path, kind: str) -> None:
    """A global-view state, or a per-replica one split within each replica: each host's
    shards are its own, so the peer keeps a copy sent at each save."""
    _group(tmp_path, "save", kind)
    shutil.rmtree(tmp_path / "sim-memory-0")
    _restored(tmp_path, kind, [1, 1])


def test_the_plan_takes_the_newest_step_every_host_of_which_is_held() -> None:
    a, b, c = {"p": "a"}, {"p": "b"}, {"p": "c"}
    # Host 0 holds steps 4 (its own and host 1's) and 6 (its own); host 1's node is new.
    held = [{4: {0: a, 1: b}, 6: {0: a}}, {}]
    assert plan(held, None) == MemoryPlan(4, (0, 0), (a, b))
    assert plan(held, None).from_peers == 1  # type: ignore[union-attr]
    assert plan(held, 4) is None  # not newer than the persistent step
    # Each from its own node when it can.
    both = plan([{6: {0: a, 1: b}}, {6: {1: b, 0: a}}], None)
    assert both == MemoryPlan(6, (0, 1), (a, b)) and both.from_peers == 0
    assert "every host's shards on its own node" in both.describe()
    # Host 2's shards are on no node: no step of three hosts is whole.
    assert plan([{2: {0: a}}, {2: {1: b}}, {}], None) is None
    # Hosts 0 and 1 both replaced: node 2 can send only one of them in one collective.
    assert plan([{}, {}, {2: {2: c, 0: a, 1: b}}], None) is None
