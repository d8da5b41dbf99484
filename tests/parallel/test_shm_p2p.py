"""Pipeline send/recv through shared memory (meshtrain/parallel/shm/p2p.py): the bytes arrive as
sent whatever the size, dtype, layout and order of the waits, rings grow and wrap, nothing is
left in /dev/shm, a missing message times out, and the Trainer uses it for a CPU pipeline (the
pipeline parity tests run on it; one of them on gloo's own send/recv instead)."""

import glob
from datetime import timedelta

import pytest
import torch
from conftest import end_together, join_gloo

from meshtrain.launch.spawn import run_workers


def _transfer_worker():
    import torch.distributed as dist

    from meshtrain.parallel.shm import p2p as shm_p2p

    join_gloo()
    shm_p2p.MIN_RING = 4096  # small rings: the messages below make them wrap and grow
    group = shm_p2p.local_p2p_group([[0, 1]], torch.device("cpu"), "auto")
    assert isinstance(group, shm_p2p.LocalP2PGroup)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    # both ranks draw the same messages: rank r sends messages[i] + r and expects + peer
    sizes = [1, 7, 300, 1000, 1024, 5, 3000, 100_000, 0, 17, 2000, 1000, 64_000, 3]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float64]
    messages = [(torch.randn(n, generator=gen) * 100).to(dtypes[i % 4])
                for i, n in enumerate(sizes)]
    received = []
    for burst in (1, 3, 5, 14):  # messages queued before the first wait
        for start in range(0, len(messages), burst):
            chunk = messages[start:start + burst]
            outs = [torch.empty_like(m) for m in chunk]
            sends = [dist.P2POp(dist.isend, m + rank, peer, group) for m in chunk]
            recvs = [dist.P2POp(dist.irecv, o, peer, group) for o in outs]
            works = dist.batch_isend_irecv(sends + recvs)
            for work in reversed(works):  # a later receive first fills the earlier ones
                work.wait()
            received += [torch.equal(o, m + peer) for o, m in zip(outs, chunk)]
    exact = all(received)
    # a non-contiguous destination (a transposed view)
    full = torch.zeros(6, 4)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(24.0).view(4, 6) + rank, peer,
                                       group),
                            dist.P2POp(dist.irecv, full.t(), peer, group)])[1].wait()
    transposed = torch.equal(full.t(), torch.arange(24.0).view(4, 6) + peer)
    generations = group._out[peer].gen
    # equal messages in bursts of 3 on a new group: at most 6 are unacknowledged at a time (a
    # rank's burst follows the peer's previous one); its rings double from one message (4096
    # bytes) until those fit (at most 8: 3 new rings), then wrap around live messages
    again = shm_p2p.local_p2p_group([[0, 1]], torch.device("cpu"), "auto")
    wrapped = []
    for burst in range(30):
        chunk = [torch.full((1000,), float(100 * burst + 10 * i + rank)) for i in range(3)]
        outs = [torch.empty(1000) for _ in chunk]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, c, peer, again) for c in chunk]
                                       + [dist.P2POp(dist.irecv, o, peer, again) for o in outs])
        for work in works:
            work.wait()
        wrapped += [torch.equal(o, c - rank + peer) for o, c in zip(outs, chunk)]
    # a /dev/shm without MIN_FREE bytes free (a container's default 64 MiB): gloo's instead
    shm_p2p.MIN_FREE = 1 << 60
    declined = shm_p2p.local_p2p_group([[0, 1]], torch.device("cpu"), "auto") is None
    end_together()
    left = glob.glob(group._out[peer].base.rsplit("-ring-", 1)[0] + "*")
    return dict(exact=exact and all(wrapped), transposed=transposed, generations=generations,
                left=left, wrap_generations=again._out[peer].gen, declined=declined)


@pytest.mark.timeout(120)
def test_messages_arrive_exactly_and_nothing_is_left_behind():
    for result in run_workers(_transfer_worker, 2, timeout=100):
        assert result["exact"] and result["transposed"]
        assert result["generations"] >= 2  # the first group's rings grew along the way
        # the second group's rings stop growing and wrap instead: 90 messages of 4000 bytes
        # (360 KB) went through at most 4 rings of 2-16 messages, so around and around. (Whether
        # a ring grows at all depends on how soon the peer reads: a CI run saw none grow.)
        assert 0 <= result["wrap_generations"] <= 3
        assert result["left"] == []  # FIFOs and rings are unlinked once both sides hold them
        assert result["declined"]


def _timeout_worker():
    import time

    import torch.distributed as dist

    from meshtrain.parallel.shm import p2p as shm_p2p

    join_gloo()
    group = dist.new_group([0, 1], backend=shm_p2p.BACKEND, timeout=timedelta(seconds=1))
    error, t0 = None, time.perf_counter()
    if dist.get_rank() == 1:  # nothing is ever sent to it
        try:
            dist.recv(torch.empty(3), src=0, group=group)
        except RuntimeError as e:
            error = str(e)
    return end_together((error, time.perf_counter() - t0))


@pytest.mark.timeout(60)
def test_a_receive_with_nothing_sent_times_out_with_the_peer_named():
    _, (error, seconds) = run_workers(_timeout_worker, 2, timeout=50)
    assert "nothing arrived from rank 0" in error and "within 1 s" in error
    assert 0.9 < seconds < 10


def _trainer_worker():
    import tempfile

    from parity import GPT_FNS

    from meshtrain import Trainer

    trainer = Trainer(layout="pp=2", max_steps=2, global_batch_size=8, micro_batch_size=2,
                      loggers=(), progress_bar=False, save_final_checkpoint=False,
                      run_dir=tempfile.mkdtemp(), seed=0)
    trainer.fit(GPT_FNS["model_fn"], GPT_FNS["data_fn"](), optimizer=GPT_FNS["optimizer_fn"],
                loss_fn=GPT_FNS["loss_fn"])
    return end_together({type(s.group).__name__ for s in trainer.engine.runner.stages})


@pytest.mark.timeout(120)
def test_the_trainer_sends_through_shared_memory_on_cpu():
    # (tests/parallel/test_pipeline_parity.py runs a schedule with local_comm="backend")
    for stage_groups in run_workers(_trainer_worker, 2, timeout=100):
        assert stage_groups == {"LocalP2PGroup"}


@pytest.mark.parametrize("ack_batch", [0, "default"])
def test_a_sender_never_overwrites_a_message_its_receiver_has_not_acknowledged(tmp_path,
                                                                               monkeypatch,
                                                                               ack_batch):
    # the ring's bookkeeping alone, in this process: random sizes, acknowledgements arriving
    # late and in order; after every send each unacknowledged message still holds its bytes.
    # The sender reads acknowledgements when its ring is full or ACK_BATCH are unread (0: at
    # every send, which wraps around live messages more often)
    import os
    import random

    from meshtrain.parallel.shm import p2p as shm_p2p

    monkeypatch.setattr(shm_p2p, "MIN_RING", 1024)
    if ack_batch != "default":
        monkeypatch.setattr(shm_p2p, "ACK_BATCH", ack_batch)
    data_r, data_w = os.pipe()
    ack_r, ack_w = os.pipe()
    out = shm_p2p._Outbound(data_w, ack_r, str(tmp_path / "ring"))
    rng, unacked, wraps = random.Random(0), [], 0
    # first, scripted (a first ring of 1024 bytes holds 8 messages of 100 bytes, 128 with their
    # alignment): fill it, ack 3, wrap 3 to the front, then one more fits nowhere (it must not
    # land on a live one: a new ring); then 400 random ones
    script = [100] * 8 + [("ack", 3)] + [100] * 4 + [("ack", 5)] + [100] * 10
    for i in range(len(script) + 400):
        step = script[i] if i < len(script) else rng.choice([1, 7, 64, 100, 250])
        if isinstance(step, tuple):
            for _ in range(step[1]):
                unacked.pop(0)
                os.write(ack_w, shm_p2p.ACK.pack(0))
            continue
        size = step
        message = torch.full((size,), i % 251, dtype=torch.uint8)
        before = out.inflight[-1][2] if out.inflight else 0
        out.send(message, tag=0)
        os.read(data_r, shm_p2p.RECORD.size)
        gen, start, _ = out.inflight[-1]
        assert start % 64 == 0  # aligned for a view of any dtype
        wraps += gen == out.gen and start < before
        unacked.append((gen, start, start + size, i % 251))
        for gen, start, end, value in unacked:
            ring = out.view if gen == out.gen else out.retired[gen]
            assert bool((ring[start:end] == value).all()), f"message {i}: a live one overwritten"
        # the receiver copies the oldest out: falling behind, then catching up, by turns
        while i >= len(script) and unacked and rng.random() < (0.35 if i // 40 % 2 else 0.7):
            unacked.pop(0)
            os.write(ack_w, shm_p2p.ACK.pack(0))
    # it wrapped around live messages, and grew
    assert wraps > (50 if ack_batch == 0 else 5) and out.gen >= 1
    # no receiver opened these rings: the group's finalizer (at exit) removes them
    assert len(list(tmp_path.glob("ring-*"))) == out.gen + 1
    shm_p2p._unlink_unread([out])
    assert list(tmp_path.glob("ring-*")) == []
    assert not out.retired or min(out.retired) >= min(g for g, *_ in unacked)


def test_a_ring_grows_to_what_ring_bytes_says_when_a_larger_message_comes_early(tmp_path,
                                                                               monkeypatch):
    # FSDP's rings: the root unit's chunk first, then a block's (larger). Sent before the first
    # is acknowledged, the larger finds no room beside it and makes the next ring: the size the
    # planner counts (ring_bytes). Acknowledged first, it fits the first ring: timing decides
    import os

    from meshtrain.parallel.shm import p2p as shm_p2p

    monkeypatch.setattr(shm_p2p, "MIN_RING", 4096)
    first, larger = 3000, 4500  # floats: 12,000 and 18,000 bytes
    for acked_between in (False, True):
        data_r, data_w = os.pipe()
        ack_r, ack_w = os.pipe()
        out = shm_p2p._Outbound(data_w, ack_r, str(tmp_path / f"ring{acked_between}"))
        out.send(torch.ones(first), tag=0)
        assert out.capacity == shm_p2p.ring_bytes(first * 4) == 24_000 + 64  # 2 aligned messages
        if acked_between:
            os.write(ack_w, shm_p2p.ACK.pack(0))
        out.send(torch.ones(larger), tag=0)
        grown = shm_p2p.ring_bytes(larger * 4, first * 4)
        if acked_between:
            assert out.capacity < grown
        else:
            assert out.capacity == grown == 2 * (24_000 + 64) > 2 * 18_048
            out.send(torch.ones(larger), tag=0)  # the next block's: room for it
            assert out.capacity == grown
        shm_p2p._unlink_unread([out])
        for fd in (data_r, data_w, ack_r, ack_w):
            os.close(fd)
    # messages of one size, two unacknowledged at a time: the first ring holds them
    assert shm_p2p.ring_bytes(18_000) == 2 * 18_048 and shm_p2p.ring_bytes(100) == 4096


def _dead_peer_worker(out: str):
    import json
    import os
    import time

    import torch.distributed as dist

    from meshtrain.parallel.shm import p2p as shm_p2p

    join_gloo()
    group = dist.new_group([0, 1], backend=shm_p2p.BACKEND)  # the default timeout: 30 min
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a word (as under SIGKILL: no exit handler runs)
    t0 = time.perf_counter()
    try:
        dist.recv(torch.empty(3), src=1, group=group)
    except RuntimeError as e:
        with open(out, "w") as f:
            json.dump([str(e), time.perf_counter() - t0], f)
    os._exit(0)  # (the default group's teardown would wait for rank 1)


@pytest.mark.timeout(60)
def test_a_receive_from_a_rank_that_exited_fails_within_seconds(tmp_path):
    import json

    from meshtrain.errors import WorkerFailed

    out = tmp_path / "rank0.json"
    with pytest.raises(WorkerFailed):  # neither rank returns a result
        run_workers(_dead_peer_worker, 2, (str(out),), timeout=50)
    error, seconds = json.loads(out.read_text())
    assert "rank 1 of this shared-memory group" in error and "exited" in error
    assert seconds < 10  # not the process group's 30 minutes


def test_a_full_shared_memory_is_a_clear_error_and_leaves_no_file(tmp_path, monkeypatch):
    import errno
    import os

    from meshtrain.parallel.shm import p2p as shm_p2p

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match="cannot take 2 MiB.*--shm-size.*local_comm='backend'"):
        shm_p2p._map(str(tmp_path / "ring"), 2 << 20)
    assert list(tmp_path.iterdir()) == []


def test_a_waiting_receiver_polls_before_it_sleeps(monkeypatch):
    # _Inbound alone, in this process: a record written 20 ms after the receive starts waiting
    # is read while polling (select, where a receiver sleeps, is never reached); without
    # polling the receiver goes to select at once
    import os
    import select
    import threading
    import time

    from meshtrain.parallel.shm import p2p as shm_p2p

    def record_later(fd):
        time.sleep(0.02)
        os.write(fd, shm_p2p.RECORD.pack(0, 64, 8, 3))

    slept = []

    def select_spy(r, w, x, timeout):
        slept.append(timeout)
        return real_select(r, w, x, timeout)

    real_select = select.select
    monkeypatch.setattr(shm_p2p.select, "select", select_spy)
    for spin_s in (30.0, 0.0):
        data_r, data_w = os.pipe()
        inbound = shm_p2p._Inbound(data_r, -1, "unused", timedelta(seconds=10), 1, os.getpid(),
                                   spin_s)
        writer = threading.Thread(target=record_later, args=(data_w,))
        writer.start()
        assert inbound._read_record() == (0, 64, 8, 3)
        writer.join()
        assert bool(slept) == (spin_s == 0.0), (spin_s, slept)
        os.close(data_r)
        os.close(data_w)


def test_receivers_poll_only_where_every_process_has_a_core(monkeypatch):
    from meshtrain.parallel.shm import p2p as shm_p2p

    monkeypatch.setattr(shm_p2p.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert shm_p2p.spin_seconds(world_size=2) == shm_p2p.SPIN_S > 0
    assert shm_p2p.spin_seconds(world_size=3) == 0.0  # a poller would take a sharer's core
