"""`meshtrain bench comm` on 2 local processes: every operation's result checked, times and
nccl-tests' bus bandwidth factors in the rows it prints and saves; bad inputs refused."""

import json

import pytest

from meshtrain.cli import main as cli
from meshtrain.errors import ConfigError
from meshtrain.plan.bench_comm import OPS, SHARED_OPS, bus_factor, parse_size, sizes_between


@pytest.mark.timeout(240)
def test_two_processes_time_every_operation(tmp_path, capfd):
    out = tmp_path / "comm.json"
    assert cli(["bench", "comm", "--devices", "2", "--max-size", "16KiB", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["world_size"] == 2 and saved["backend"] == "gloo"
    rows = saved["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, size) for op in OPS for size in (1024, 4096, 16384)]
    for row in rows:
        assert row["seconds"] > 0 and row["iters"] >= 3
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * bus_factor(row["op"], 2))
    printed = capfd.readouterr().out
    assert "meshtrain bench comm: 2 processes, gloo" in printed
    assert "all_reduce" in printed and "16 KiB" in printed
    # the drift each collective adds between bursts of compute, which the planner charges
    assert saved["drift_seconds"] >= 0 and "drift: a collective between" in printed
    # what meshtrain runs through shared memory on one host, measured that way too (each
    # result checked), and what the planner prices FSDP's collectives and pipeline sends with
    assert [(r["op"], r["bytes"]) for r in saved["shared_rows"]] == [
        (op, size) for op in SHARED_OPS for size in (1024, 4096, 16384)]
    assert "through shared memory" in printed
    from meshtrain.plan.cluster import Cluster

    cluster = Cluster.preset("this-machine", processes=2, comm=out)
    assert cluster.drift == saved["drift_seconds"]
    shared = {(r["op"], r["bytes"]): r["seconds"] for r in saved["shared_rows"]}
    gloo = {(r["op"], r["bytes"]): r["seconds"] for r in rows}
    for op in SHARED_OPS:
        assert cluster.comm_seconds(op, 4096, 2, crosses_nodes=False, shared=True) \
            == pytest.approx(shared[op, 4096])
        assert cluster.comm_seconds(op, 4096, 2, crosses_nodes=False) \
            == pytest.approx(gloo[op, 4096])
        assert cluster.comm_seconds(op, 4096, 2, crosses_nodes=True, shared=True) \
            == pytest.approx(gloo[op, 4096])  # other hosts: no shared memory


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_to_all", 4) == 3 / 4
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 8) == 1.0


def test_sizes():
    assert parse_size("1KiB") == 1024 and parse_size("256MiB") == 256 * 2**20
    assert parse_size("4096") == 4096 and parse_size("2M") == 2 * 2**20
    assert sizes_between(1024, 16384) == [1024, 4096, 16384]
    for bad in ("12XB", "KiB", "0", "-4"):
        with pytest.raises(ConfigError, match="not a size"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="above --max-size"):
        sizes_between(4096, 1024)


def test_bad_invocations_are_refused_before_any_process(capsys):
    assert cli(["bench", "comm", "--devices", "1"]) == 2
    assert "--devices N (N >= 2" in capsys.readouterr().err
    assert cli(["bench", "memory"]) == 2
    assert "meshtrain bench comm" in capsys.readouterr().err
