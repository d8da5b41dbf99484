"""Fault tolerance: what keeps a long run alive and tells what went wrong (docs/fault_tolerance.md).

The loop talks to one object, :class:`~meshtrain.fault.guard.StepGuard`, through a narrow
interface (:class:`~meshtrain.fault.guard.Loop`); behind it:

* ``nonfinite.py``: NaN/Inf detection and ``nan_policy`` (error, skip, rollback), agreed by one
  small all-reduce per step;
* ``watchdog.py``: the stall watchdog (every rank's stacks, then exit);
* ``desync.py``: ``debug_collectives`` (which rank called which collective) and per-group
  collective timeouts;
* ``checks.py``: the settings of all of them, checked before any process starts.

Restarts after a crash are the launcher's (``launch/spawn.py``, torchrun); resuming is
``checkpoint/resume.py``.
"""

from meshtrain.fault.checks import check_settings
from meshtrain.fault.guard import FaultOptions, Loop, StepGuard, set_collective_timeout
from meshtrain.fault.nonfinite import NAN_POLICIES, NonFiniteError

__all__ = ["FaultOptions", "Loop", "NAN_POLICIES", "NonFiniteError", "StepGuard",
           "check_settings", "set_collective_timeout"]
