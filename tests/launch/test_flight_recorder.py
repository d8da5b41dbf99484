"""NCCL's flight recorder is on for NCCL process groups (meshtrain/launch/spawn.py): its
settings reach the process group's creation, a user's own settings win, gloo is left alone,
and once the run folder is known the dumps go there. (A dump on a real NCCL timeout needs a
GPU machine.)"""

from datetime import timedelta

import torch.distributed as dist

from meshtrain.launch import spawn


def _created(monkeypatch, backend: str, **env) -> dict:
    seen = {}

    def fake_init(backend_, **kwargs):
        import os

        seen.update({k: os.environ.get(k) for k in spawn.FLIGHT_RECORDER})

    for name in spawn.FLIGHT_RECORDER:  # (set, then removed: put back as it was after)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(spawn, "register_shutdown", lambda: None)
    spawn.init_process_group(spawn.DistEnv(rank=0, world_size=1, local_rank=0,
                                           local_world_size=1),
                             backend, timedelta(seconds=5), store=object())
    return seen


def test_nccl_gets_the_flight_recorder_and_gloo_does_not(monkeypatch, tmp_path):
    seen = _created(monkeypatch, "cpu:gloo,cuda:nccl")
    assert seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    environ = dict(seen)
    spawn.flight_recorder_defaults(environ, str(tmp_path))  # the run folder, once known
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    assert (tmp_path / "flight_recorder").is_dir()
    assert _created(monkeypatch, "gloo")["TORCH_NCCL_TRACE_BUFFER_SIZE"] is None
    # a user's own setting wins (0: off)
    assert _created(monkeypatch, "nccl", TORCH_NCCL_TRACE_BUFFER_SIZE="0")[
        "TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
