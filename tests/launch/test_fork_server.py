"""run_workers forks its workers from a single-threaded server (issue 26 item 11).

A fork of a process with other threads may copy a heap or a lock mid-update: a worker of
benchmarks/tensor_parallel.py once died with "malloc(): unaligned tcache chunk detected"."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from meshtrain.launch.fork_guard import thread_names
from meshtrain.launch.spawn import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _server_threads_at_fork():
    from meshtrain.launch.fork_guard import threads_at_fork

    return list(threads_at_fork)


def test_workers_are_forked_from_a_single_thread():
    """With the suite's preload (torch, meshtrain, transformers): one thread at every fork."""
    for seen in run_workers(_server_threads_at_fork, 2, timeout=60):
        assert len(seen) == 1, seen


def _fit_and_list_new_imports(layout):
    import sys

    from parity import GPT_FNS, train_state

    before = set(sys.modules)
    train_state(dict(layout=layout, max_steps=2, global_batch_size=16, micro_batch_size=4),
                **GPT_FNS)
    return sorted(name for name in set(sys.modules) - before
                  if name.startswith(("meshtrain.", "torch.distributed", "torch._dynamo"))
                  and not name.startswith("meshtrain.models."))  # the user's model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["zero3=2", "pp=2", "tp=2", "cp=2"])
def test_a_workers_fit_imports_nothing_the_server_could_have(layout):
    """meshtrain.launch.worker_imports: what a fit imports is imported once, in the server (a
    worker importing dynamo, DCP and the schedules itself spent a second of a two-second job)."""
    for new in run_workers(_fit_and_list_new_imports, 2, (layout,), timeout=100):
        assert new == [], new


def test_thread_names_sees_every_thread():
    stop = threading.Event()
    before = len(thread_names())
    worker = threading.Thread(target=stop.wait, name="extra")
    worker.start()
    try:
        assert len(thread_names()) == before + 1
    finally:
        stop.set()
        worker.join()


JOB = """
import os
from meshtrain.errors import WorkerFailed
from meshtrain.launch import spawn

def work():
    from meshtrain.launch.fork_guard import threads_at_fork
    return len(threads_at_fork), os.environ.get("OMP_NUM_THREADS")

if __name__ == "__main__":
    # torch alone (what these tests are about), not what a Trainer's worker needs besides
    spawn.FORKSERVER_PRELOAD[:] = ["torch", *{preload}]
    try:
        print("threads at fork:", spawn.run_workers(work, 2, timeout=60))
    except WorkerFailed as e:
        print(e)
"""


def _launch(tmp_path, preload=(), **environ):
    (tmp_path / "job.py").write_text(JOB.format(preload=list(preload)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    for key, value in environ.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    out = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    return out.stdout + out.stderr


def test_without_omp_num_threads_the_server_has_no_openmp_pool(tmp_path):
    """The cause of the heap crash: with OMP_NUM_THREADS unset (benchmarks, meshtrain parity),
    importing torch in the server started an OpenMP pool, and workers were forks of a
    multi-threaded process. The server now starts with one OpenMP thread."""
    # (and the workers see the launching process's environment: no OMP_NUM_THREADS)
    assert "threads at fork: [(1, None), (1, None)]" in _launch(tmp_path, OMP_NUM_THREADS=None)


def test_a_server_with_threads_refuses_to_run_workers(tmp_path):
    """A preloaded module that starts a thread makes every worker fail, naming the threads."""
    (tmp_path / "starts_a_thread.py").write_text(textwrap.dedent("""
        import threading, time
        threading.Thread(target=time.sleep, args=(600,), daemon=True, name="sleeper").start()
    """))
    out = _launch(tmp_path, ["starts_a_thread"])
    assert "the fork server had 2 threads" in out, out
    assert "sleeper" in out
