"""run_workers forks its workers from a single-threaded server (issue 26 item 11).

A fork of a process with other threads may copy a heap or a lock mid-update: a worker of
benchmarks/tensor_parallel.py once died with "malloc(): unaligned tcache chunk detected"."""
import os
import subprocess
import sys
import textwrap
import threading

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


def test_a_server_with_threads_refuses_to_run_workers(tmp_path):
    """A preloaded module that starts a thread makes every worker fail, naming the threads."""
    (tmp_path / "starts_a_thread.py").write_text(textwrap.dedent("""
        import threading, time
        threading.Thread(target=time.sleep, args=(600,), daemon=True, name="sleeper").start()
    """))
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os
        from meshtrain.errors import WorkerFailed
        from meshtrain.launch import spawn

        def work():
            return os.getpid()

        if __name__ == "__main__":
            spawn.FORKSERVER_PRELOAD.append("starts_a_thread")
            try:
                spawn.run_workers(work, 2, timeout=60)
            except WorkerFailed as e:
                print(e)
            else:
                print("ran")
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert "the fork server had 2 threads" in out.stdout, out.stdout + out.stderr
    assert "sleeper" in out.stdout
