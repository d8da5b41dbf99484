"""What a rank's memory is measured against (meshtrain/observe/memory/limit.py) and how the
report shows it: a GPU's own memory per rank; on CPU the node's memory (a cgroup's limit when
set), shared by the node's ranks, never each rank's own."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import pytest
import torch

from meshtrain.observe import run_files
from meshtrain.observe.memory import limit
from meshtrain.observe.memory.limit import cgroup_memory_limit, host_memory_limit, \
    physical_memory
from meshtrain.observe.report import write_report

pytestmark = pytest.mark.timeout(120)
GIB = 2**30


def cgroups(tmp_path: Path, proc: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup holding ``proc`` and a cgroup tree with ``limits`` {file: value}."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(proc)
    root = tmp_path / "sys"
    for name, value in limits.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(value + "\n")
    return tmp_path / "cgroup", root


def test_a_cgroup_v2_limit_above_the_process_counts(tmp_path):
    proc, root = cgroups(tmp_path, "0::/job/step/task\n", {
        "job/memory.max": str(6 * GIB), "job/step/memory.max": "max",
        "job/step/task/memory.max": str(8 * GIB)})
    assert cgroup_memory_limit(proc, root) == (6 * GIB, str(root / "job/memory.max"))


def test_a_cgroup_v1_limit_and_v1s_no_limit(tmp_path):
    proc, root = cgroups(tmp_path, "5:cpu:/x\n4:memory:/slurm/job1\n", {
        "memory/slurm/job1/memory.limit_in_bytes": str(3 * GIB),
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_limit(proc, root)[0] == 3 * GIB
    proc, root = cgroups(tmp_path / "none", "4:memory:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_limit(proc, root) is None  # v1's "no limit"
    assert cgroup_memory_limit(tmp_path / "no such file", root) is None


def test_a_cgroup_limit_below_the_machines_memory_is_what_a_cpu_rank_is_measured_against(
        tmp_path, monkeypatch):
    proc, root = cgroups(tmp_path, "0::/job\n", {"job/memory.max": str(GIB)})
    monkeypatch.setattr(limit, "PROC_CGROUP", proc)
    monkeypatch.setattr(limit, "CGROUP_ROOT", root)
    limit.host_memory_limit.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert limit.memory_peak_and_limit(cpu)[1] == GIB
        assert limit.limit_description(cpu) == {
            "memory_limit_scope": "node",
            "memory_limit_source": f"cgroup limit ({root / 'job' / 'memory.max'})"}
    finally:
        limit.host_memory_limit.cache_clear()  # this machine's again


def test_the_hosts_limit_is_at_most_its_physical_memory():
    limit, source = host_memory_limit()
    assert 0 < limit <= physical_memory()
    assert source == "the machine's physical memory" or source.startswith("cgroup limit (")


def cpu_run(tmp_path: Path, *, nodes: int, per_node: int, **environment) -> Path:
    """A finished CPU run of nodes x per_node ranks, rank r's peak (1 + r) GiB, every rank's
    limit its node's 16 GiB."""
    run = tmp_path / "run"
    run.mkdir()
    world = nodes * per_node
    run_files.update_environment(run, **{"device_type": "cpu", **environment},
                                 world_size=world, nodes=nodes, processes_per_node=per_node,
                                 status="finished")
    parts = {f"{p}_s": 0.01 for p in run_files.PARTS}
    run_files.append_breakdown(run, [
        {"step": 10, "rank": r, "wall_s": 0.07, "step_s": 0.07, **parts,
         "mem_peak_bytes": (1 + r) * GIB, "mem_limit_bytes": 16 * GIB} for r in range(world)])
    return run


def memory_text(run: Path) -> str:
    html = write_report(run).read_text()
    section = re.search(r'<section id="memory">(.*?)</section>', html, re.S)[1]
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", section)).split())


def test_ranks_on_one_cpu_node_share_its_memory(tmp_path):
    text = memory_text(cpu_run(tmp_path, nodes=1, per_node=2, memory_limit_scope="node",
                               memory_limit_source="cgroup limit (/sys/fs/cgroup/memory.max)"))
    assert ("On a CPU the ranks of a node share its memory: the limit is the node's (cgroup "
            "limit (/sys/fs/cgroup/memory.max)), not each rank's.") in text
    # the node's line: both ranks' peaks summed against its memory
    assert "the node ranks 0-1 3.00 GiB 16.00 GiB 19%" in text
    assert "limit: the node's memory, shared by its ranks" in text
    assert "0 1.00 GiB 16.00 GiB 6%" in text and "1 2.00 GiB 16.00 GiB 12%" in text


def test_each_node_of_a_multi_node_cpu_run_has_its_line(tmp_path):
    # a run folder from before the scope was recorded: a CPU's limit is the node's
    text = memory_text(cpu_run(tmp_path, nodes=2, per_node=2))
    assert "the machine's physical memory" in text
    assert "node 0 ranks 0-1 3.00 GiB 16.00 GiB 19%" in text
    assert "node 1 ranks 2-3 7.00 GiB 16.00 GiB 44%" in text


def test_a_gpus_memory_is_each_ranks_own(tmp_path):
    run = cpu_run(tmp_path, nodes=1, per_node=2, device_type="cuda",
                  memory_limit_scope="device", memory_limit_source="the GPU's memory")
    text = memory_text(run)
    assert "Each rank's limit is its own GPU's memory" in text
    assert "limit: its GPU's memory" in text and "shared" not in text
