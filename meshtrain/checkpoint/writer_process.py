"""A checkpoint writer in a process of its own: the file writes of an asynchronous save, off the
training process's interpreter.

An asynchronous save (``async_checkpoint``) stages the state into host buffers
(:mod:`meshtrain.checkpoint.staging`) and DCP writes them while training goes on. In a thread of
the training process that write competes with training for the GIL: ``torch.save`` of every
tensor into its file, through Python file objects. Here the staged buffers live in shared-memory
files (:class:`SharedBuffers`, one per buffer of 64 KiB or more) that a writer process maps too,
and :class:`ProcessFileWriter` (DCP's ``FileSystemWriter`` in the training process: the plan, the
file names, the metadata) hands each save's files to that process, which writes them with
DCP's own ``FileSystemWriter`` code (same format, same fsync) and returns the write results.
Nothing is copied on the way: a tensor travels as the file it lies in, its shape and strides.

The writer is started with ``subprocess`` (so a daemonic worker of ``run_workers`` can start it,
which ``multiprocessing`` refuses), imports torch alone, reads requests on its stdin and exits
when that closes, and on Linux is killed with its training process (``PR_SET_PDEATHSIG``, when
started from the main thread), so a write is never left running after the training process
ends, however it ends. Each buffer's file is
unlinked as soon as the writer has mapped it; the training process unlinks any it never got.

This file runs as the writer's main module: it imports nothing of meshtrain.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
import uuid
import weakref
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

SMALL = 64 << 10  # bytes: smaller buffers are ordinary memory, sent by value
PROTOCOL = pickle.HIGHEST_PROTOCOL
SHARED_DIR = "/dev/shm"  # where the buffers' files go (tmpfs)


def shared_memory_fits(nbytes: int) -> bool:
    """Whether :data:`SHARED_DIR` exists and has twice ``nbytes`` free."""
    if not os.path.isdir(SHARED_DIR):
        return False
    stat = os.statvfs(SHARED_DIR)
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


class SharedBuffers:
    """Host buffers the writer process can map: a file per buffer in ``directory`` (tmpfs;
    default :data:`SHARED_DIR`)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or SHARED_DIR
        self.token, self.count = uuid.uuid4().hex[:12], 0
        # storage data_ptr -> (path, bytes, the buffer: held, so no other tensor takes its
        # address while it is registered)
        self.files: dict[int, tuple[str, int, torch.Tensor]] = {}
        self.unread: set[str] = set()  # files the writer has not mapped (and unlinked) yet
        weakref.finalize(self, _unlink, self.unread)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer. Its pages are taken now: a full ``directory`` is an error
        here, not a SIGBUS in the background copy."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < SMALL:
            return torch.empty(shape, dtype=dtype)
        path = f"{self.directory}/meshtrain-ckpt-{self.token}-{self.count}"
        self.count += 1
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise RuntimeError(
                f"the asynchronous checkpoint cannot take {nbytes / 2**20:.1f} MiB more in "
                f"{self.directory} for its host copy ({exc}); free some, give it more room "
                "(e.g. docker run --shm-size=...), or save synchronously (async_checkpoint="
                "false)") from None
        finally:
            os.close(fd)
        self.unread.add(path)
        buffer = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype)
        buffer = buffer.view(shape)
        self.files[buffer.untyped_storage().data_ptr()] = (path, nbytes, buffer)
        return buffer

    def clear(self) -> None:
        """Forget every buffer (a new set is made for a state of another layout)."""
        self.files.clear()
        _unlink(self.unread)
        self.unread.clear()

    def describe(self, tensor: torch.Tensor) -> tuple:
        """What the writer needs to find ``tensor`` (a view of a buffer, or a small one)."""
        found = self.files.get(tensor.untyped_storage().data_ptr())
        if found is None:
            return ("value", tensor.detach().clone())
        path, nbytes, _ = found
        return ("shared", path, nbytes, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset())

    def mapped(self, paths) -> None:
        self.unread.difference_update(paths)


class WriterProcess:
    """The writer process of one training process (started at once, in the background)."""

    def __init__(self):
        code = f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # (the parent-death signal follows the thread that starts the process: only the main
        # thread's lasts as long as the process)
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(int(main))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._ready = False
        weakref.finalize(self, _stop, self.proc)

    def _reply(self):
        try:
            status, result = pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            raise RuntimeError(f"the checkpoint writer process (pid {self.proc.pid}) exited "
                               f"(code {self.proc.poll()})") from exc
        if status == "error":
            raise RuntimeError(f"the checkpoint writer process failed: {result}")
        return result

    def wait_ready(self) -> None:
        """Block until the process has imported what it writes with (once, ~2 s of CPU)."""
        if not self._ready:
            self._reply()
            self._ready = True

    def write(self, request: dict):
        """Send one save's files; block (releasing the GIL) until they are written."""
        self.wait_ready()
        try:
            pickle.dump(request, self.proc.stdin, protocol=PROTOCOL)
            self.proc.stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"the checkpoint writer process (pid {self.proc.pid}) exited "
                               f"(code {self.proc.poll()})") from exc
        return self._reply()

    def close(self) -> None:
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _unlink(paths: set[str]) -> None:
    for path in list(paths):
        if os.path.exists(path):
            os.unlink(path)


class ProcessFileWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose file writes run in ``process`` (tensors found in
    ``buffers``); planning, file names and the metadata stay in this process."""

    def __init__(self, path, process: WriterProcess, buffers: SharedBuffers, **kwargs):
        super().__init__(path, **kwargs)
        self.process, self.buffers = process, buffers

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        files = []
        while not file_queue.empty():
            path, file_name, items = file_queue.get_nowait()
            entries = []
            for item in items:
                data = planner.resolve_data(item)
                entries.append((item, ("bytes", data.getvalue())
                                if item.type == WriteItemType.BYTE_IO
                                else self.buffers.describe(data)))
            files.append((str(path), file_name, entries))
        results, mapped = self.process.write({
            "path": str(self.path), "sync_files": self.sync_files, "files": files,
            "live": sorted(path for path, _, _ in self.buffers.files.values())})
        self.buffers.mapped(mapped)
        future: Future = Future()
        future.set_result(results)
        return future


# -------------------------------------------------------------------------------------------------
# the writer process
# -------------------------------------------------------------------------------------------------
class _Resolved:
    """The planner's one use in ``FileSystemWriter._write_data``: each item's data."""

    def __init__(self, data: dict[int, object]):
        self.data = data

    def resolve_data(self, item):
        return self.data[id(item)]


def _write(request: dict, maps: dict[str, torch.Tensor]) -> tuple[list, list[str]]:
    for path in set(maps) - set(request["live"]):  # buffers of an earlier state layout
        del maps[path]
    mapped, data, file_queue = [], {}, queue.Queue()
    for path, file_name, entries in request["files"]:
        for item, payload in entries:
            if payload[0] == "bytes":
                data[id(item)] = io.BytesIO(payload[1])
            elif payload[0] == "value":
                data[id(item)] = payload[1]
            else:
                _, where, nbytes, dtype, shape, stride, offset = payload
                if where not in maps:
                    maps[where] = torch.from_file(where, shared=True, dtype=dtype,
                                                  size=nbytes // dtype.itemsize)
                    os.unlink(where)
                    mapped.append(where)
                data[id(item)] = maps[where].as_strided(shape, stride, offset)
        file_queue.put((Path(path), file_name, [item for item, _ in entries]))
    writer = FileSystemWriter(request["path"], sync_files=request["sync_files"], thread_count=1)
    results = writer._write_data(_Resolved(data), file_queue).wait()
    return results, mapped


def _die_with_parent() -> None:
    """Linux: this process is killed when the training process dies (a write in progress is
    never committed then; without this it would finish into a folder a restarted job
    clears). Elsewhere the closed pipe ends it once the write in progress is done."""
    if sys.platform.startswith("linux") and sys.argv[2] == "1":
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit(0)  # the parent died before the line above


def main() -> None:
    _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the training process's stderr
    maps: dict[str, torch.Tensor] = {}
    pickle.dump(("ready", None), stdout, protocol=PROTOCOL)
    stdout.flush()
    while True:
        try:
            request = pickle.load(stdin)
        except EOFError:  # the training process closed the pipe, or ended
            return
        try:
            reply = ("ok", _write(request, maps))
        except BaseException:  # noqa: BLE001 - reported to the training process
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, stdout, protocol=PROTOCOL)
        stdout.flush()


if __name__ == "__main__":
    main()
