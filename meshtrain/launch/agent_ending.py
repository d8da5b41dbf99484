"""What `meshtrain run`'s agent records when its workers fail: around torchrun (launch/torchrun.py)
the run's ending is written into the run folder from what every local rank recorded
(launch/endings.py's records), with the report (observe/ending.py)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def agent_records(args):
    """Around torchrun in `meshtrain run`'s agent: rank 0 announces its run folder in a file
    (``MESHTRAIN_RUN_DIR_FILE``); when the workers fail (or the agent is interrupted), the
    run's ending is written there from what every local rank recorded, with the report
    (observe/ending.py), where no worker recorded more. A log folder the agent made itself
    (``args.meshtrain_temp_log_dir``) is removed after a success without restarts: it holds
    only empty folders then (after a failure or a restart, the failed workers' error files)."""
    import glob
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from meshtrain.observe import ending

    fd, path = tempfile.mkstemp(prefix="meshtrain-run-dir-", suffix=".json")
    os.close(fd)
    before = os.environ.get(ending.RUN_DIR_FILE_ENV)
    os.environ[ending.RUN_DIR_FILE_ENV] = path
    try:
        yield
    except ChildFailedError as err:
        ending.record_agent_ending(err, path)
        raise
    except SignalException as exc:
        ending.record_interrupted(path, int(exc.sigval))
        raise
    else:
        if getattr(args, "meshtrain_temp_log_dir", False) and args.log_dir and not [
                p for p in glob.glob(os.path.join(glob.escape(args.log_dir), "*", "attempt_*"))
                if not p.endswith("attempt_0")]:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    finally:
        os.unlink(path)
        if before is None:
            os.environ.pop(ending.RUN_DIR_FILE_ENV, None)
        else:
            os.environ[ending.RUN_DIR_FILE_ENV] = before
