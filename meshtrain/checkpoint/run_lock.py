"""One job at a time in a run folder: ``RUN_DIR/.meshtrain.lock``.

Two jobs writing one run folder interleave metrics.csv rows and overwrite each other's
checkpoints. So rank 0 takes the folder's lock when the run folder is chosen, before anything
is written into it, and gives it back when fit ends:

* the file holds who has it (host, pid, the job's launcher id, since when) and is held with
  ``flock`` by that process, which the kernel releases when the process dies;
* another job finding it held by a live process is refused, naming that host and pid; a lock
  left by a process that died on this host is taken over, and said; one held on another host
  (where meshtrain cannot see whether it still runs) is refused unless it is this same job's
  (the same torchrun run id: an earlier attempt whose rank 0 ran elsewhere);
* given back, the file stays with ``"held": false`` and the job's id, so that a restarted job
  finds the run folder its earlier attempt used even when that attempt saved no checkpoint
  (:func:`folder_of_this_job`).

``flock`` works between processes of one host; across hosts on a shared file system it depends
on that file system, hence the host check.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from meshtrain.errors import ConfigError

LOCK = ".meshtrain.lock"
_held: dict[Path, int] = {}  # run folder -> the open descriptor holding its flock


def job_id() -> str | None:
    """What stays the same across the restarts of one job: torchrun's run id (``meshtrain run``
    makes one per command) or Slurm's job id (kept by a requeue)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or None


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        data = json.loads(os.read(fd, 65536).decode() or "{}")
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


def _write(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, data)


def _alive(pid) -> bool:
    """Is process ``pid`` of this host running (a zombie is not)?"""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def holder_text(record: dict) -> str:
    since = record.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    job = f", job {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on host {record.get('host')}{when}{job}"


def acquire(run_dir: str | os.PathLike) -> str | None:
    """Take ``run_dir``'s lock for this process (again: a no-op). Returns a line to print when
    a lock left behind was taken over; raises ConfigError when another job holds it."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return None
    host, pid = socket.gethostname(), os.getpid()
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        before, note = _read(fd), None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by a live process, or by one its dead holder forked
            if not (before.get("host") == host and not _alive(before.get("pid"))):
                raise _refusal(run_dir, before) from None
            note = (f"run folder {run_dir}: took over the lock of {holder_text(before)}, which "
                    "is no longer running (a process it started still has the file open)")
        if before.get("held") and before.get("pid") != pid and note is None:
            same_job = job_id() is not None and before.get("job") == job_id()
            if before.get("host") == host or same_job:  # its flock is gone: it ended
                why = ("an earlier attempt of this job" if same_job else
                       "a process that is no longer running")
                note = (f"run folder {run_dir}: took over the lock left by {why} "
                        f"({holder_text(before)})")
            else:  # another host: whether it still runs cannot be seen from here
                raise _refusal(run_dir, before, elsewhere=True)
        _write(fd, {"held": True, "host": host, "pid": pid, "job": job_id(),
                    "since": time.time()})
    except BaseException:
        os.close(fd)
        raise
    _held[run_dir] = fd
    return note


def _refusal(run_dir: Path, record: dict, elsewhere: bool = False) -> ConfigError:
    gone = (f"; if that job is no longer running, delete {run_dir / LOCK}" if elsewhere else "")
    return ConfigError(
        f"run folder {run_dir} is being written by another job ({holder_text(record)}): two "
        "jobs in one folder interleave metrics.csv rows and overwrite each other's "
        f"checkpoints. Wait for it to end or stop it, or give this job another run_dir (or "
        f"resume=None for a new folder){gone}")


def release(run_dir: str | os.PathLike | None = None) -> None:
    """Give back the lock of ``run_dir`` (None: every lock this process holds); the file stays,
    marked not held, with the job's id."""
    folders = list(_held) if run_dir is None else [Path(run_dir).resolve()]
    for folder in folders:
        fd = _held.pop(folder, None)
        if fd is None:
            continue
        try:
            _write(fd, {**_read(fd), "held": False, "until": time.time()})
        except OSError:
            pass
        finally:
            os.close(fd)  # (closing releases the flock)


atexit.register(release)


def folder_of_this_job(job_folder: Path) -> Path | None:
    """The run folder in ``job_folder`` (``root_dir/name``) whose lock names this job's id
    (:func:`job_id`), newest first: where an earlier attempt of this job wrote. None when the
    job has no id or no such folder."""
    job = job_id()
    if job is None or not job_folder.is_dir():
        return None
    found = []
    for lock in job_folder.glob(f"*/{LOCK}"):
        try:
            record = json.loads(lock.read_text() or "{}")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("job") == job:
            found.append((lock.stat().st_mtime, lock.parent))
    return max(found)[1] if found else None
