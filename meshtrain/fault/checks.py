"""The fault-tolerance settings, checked together before any process starts."""

from __future__ import annotations

from meshtrain.errors import ConfigError


def _positive_number(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{name} must be a positive number{' or None' * allow_none}, "
                          f"got {value!r}")


def check_settings(settings: dict) -> None:
    """Timeouts, watchdog, nan_policy and the checkpoint settings they depend on."""
    from meshtrain.checkpoint.manager import check_options
    from meshtrain.checkpoint.resume import check_resume
    from meshtrain.fault.nonfinite import check_nan_policy

    s = settings
    for name in ("collective_timeout_s", "init_timeout_s", "mtbf_hours"):
        _positive_number(name, s[name])
    stall_timeout_s = s["stall_timeout_s"]
    _positive_number("stall_timeout_s", stall_timeout_s, allow_none=True)
    if stall_timeout_s is not None and stall_timeout_s >= s["collective_timeout_s"]:
        raise ConfigError(
            f"stall_timeout_s={stall_timeout_s} must be below collective_timeout_s="
            f"{s['collective_timeout_s']}: otherwise the ranks waiting for a stalled one time "
            "out and exit before the watchdog can write their stacks")
    every_n_steps, every_n_minutes = s["checkpoint_every_n_steps"], s["checkpoint_every_n_minutes"]
    try:
        check_options(every_n_steps=every_n_steps, keep_last_k=s["keep_last_k"],
                      every_n_minutes=every_n_minutes, async_save=s["async_checkpoint"])
    except ConfigError as error:  # name the Trainer's arguments, not the manager's
        raise ConfigError(str(error).replace("every_n", "checkpoint_every_n")
                          .replace("async_save", "async_checkpoint")) from None
    check_resume(s["resume"])
    check_nan_policy(s["nan_policy"])
    if s.get("sdc_check_every_n_steps") and s["nan_policy"] is None:
        raise ConfigError(
            "sdc_check_every_n_steps acts on a mismatch as nan_policy says, and nan_policy is "
            "None: set nan_policy ('error', 'skip' or 'rollback'), or sdc_check_every_n_steps="
            "None")
    if s["nan_policy"] == "rollback" and not (every_n_steps or every_n_minutes):
        raise ConfigError(
            "nan_policy='rollback' restores the last checkpoint, so it needs periodic "
            "checkpoints: set checkpoint_every_n_steps (or checkpoint_every_n_minutes)")
