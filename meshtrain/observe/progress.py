"""Training progress display for global rank zero.

On a terminal, ``ProgressBar`` drives a ``rich`` progress bar that redraws on its own thread.
Anywhere else (CI, pipes, log files) it prints a plain line now and then::

    step 120/400 | loss 2.31 | lr 3.00e-04 | 12.3k tok/s | eta 0:01:10

at the first update, after every 10% of the steps or ``plain_interval_s`` seconds (whichever
comes first), and once more on ``close()``. ``update`` only stores the step and metrics; metric
values are turned into numbers when a line is drawn, so passing tensors does not force a device
sync on every step (but each drawn line does sync once per tensor).

Given a ``logger``, every line goes through it at INFO (the plain lines, ``log()``'s), so the
logger's level and handlers decide what is shown and where; while the rich bar is live, the
logger's handlers that write to the bar's terminal are replaced by one that prints above the
bar (clear the bar, write the line, draw the bar again), as tqdm's ``logging_redirect_tqdm``
does, and put back on ``close()``. Its other handlers (a file, your own) get every line as
they are.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

from meshtrain.errors import ConfigError

__all__ = ["ProgressBar", "format_metrics"]

_KNOWN = ("loss", "lr", "tokens_per_s", "samples_per_s")


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _si(x: float) -> str:
    """12345 -> '12.3k', 1.5e6 -> '1.50M'."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    """Seconds as ``h:mm:ss``."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``loss 2.31 | lr 3.00e-04 | 12.3k tok/s`` then other metrics by name; skips non-numbers."""
    parts: list[str] = []
    loss = _num(metrics.get("loss"))
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    lr = _num(metrics.get("lr"))
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    for key, unit in (("tokens_per_s", "tok/s"), ("samples_per_s", "samples/s")):
        rate = _num(metrics.get(key))
        if rate is not None:
            parts.append(f"{_si(rate)} {unit}")
    for name, value in metrics.items():
        if name in _KNOWN:
            continue
        v = _num(value)
        if v is not None:
            parts.append(f"{name} {v:.4g}")
    return " | ".join(parts)


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # closed or odd streams
        return False


class ProgressBar:
    """Show training progress: step/total, loss, tokens/s and ETA.

    ``ProgressBar(total_steps, enabled=rank == 0)``; call ``start()`` (or use ``with``), then
    ``update(step, metrics)`` after every optimizer step, ``log(message)`` for one-off lines such
    as validation results, and ``close()`` at the end. ``step`` counts completed steps (1..total);
    a resumed run may start above 1. With ``enabled=False`` every method does nothing.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        refresh_per_second: float = 4,
        stream: IO[str] | None = None,
        plain_interval_s: float = 30.0,
        logger: logging.Logger | None = None,
    ) -> None:
        if int(total_steps) < 1:
            raise ConfigError(f"total_steps must be at least 1, got {total_steps}")
        if refresh_per_second <= 0:
            raise ConfigError(f"refresh_per_second must be positive, got {refresh_per_second}")
        if plain_interval_s <= 0:
            raise ConfigError(f"plain_interval_s must be positive, got {plain_interval_s}")
        self.total_steps = int(total_steps)
        self.enabled = bool(enabled)
        self.refresh_per_second = refresh_per_second
        self.plain_interval_s = float(plain_interval_s)
        self.stream = stream
        self.logger = logger
        self._replaced: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
        self.rich_mode = False
        self._progress = None  # rich.progress.Progress in rich mode
        self._task = None
        self._started = False
        self._closed = False
        # plain-mode state
        self._step: int | None = None
        self._metrics: Mapping[str, Any] = {}
        self._first_step: int | None = None
        self._t_first = 0.0
        self._printed_step: int | None = None
        self._next_step = 0
        self._next_time = 0.0
        self._every = max(1, self.total_steps // 10)

    # -- lifecycle --
    def start(self) -> ProgressBar:
        """Begin showing progress (rich bar on a terminal, plain lines otherwise)."""
        if not self.enabled or self._started:
            return self
        self._started = True
        if self.stream is None:
            self.stream = sys.stdout
        self.rich_mode = _is_terminal(self.stream)
        if self.rich_mode:
            self._start_rich()
        return self

    def close(self) -> None:
        """Stop the bar (rich) or print the final line (plain); safe to call twice."""
        if not self.enabled or not self._started or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            try:
                self._progress.stop()
            finally:
                self._restore_handlers()
        elif self._step is not None and self._printed_step != self._step:
            self._print_line()

    def __enter__(self) -> ProgressBar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per step --
    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record completed ``step`` and its metrics (keys like ``loss``, ``lr``, ``tokens_per_s``)."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        metrics = dict(metrics) if metrics else {}
        if self._progress is not None:
            if self._first_step is None:
                # reset, not update: a resumed run's jump from 0 to `step` must not count as speed
                self._first_step = step
                self._progress.reset(self._task, completed=step, metrics=metrics)
            else:
                self._progress.update(self._task, completed=step, metrics=metrics)
            return
        now = time.monotonic()
        self._step, self._metrics = step, metrics
        if self._first_step is None:
            self._first_step, self._t_first = step, now
            self._print_line(now)
        elif step >= self._next_step or now >= self._next_time:
            self._print_line(now)

    def log(self, message: str) -> None:
        """Print ``message`` on its own line (above the bar in rich mode; through the logger
        when there is one)."""
        if not self.enabled:
            return
        if self.logger is not None:
            self.logger.info(message)
            return
        if self._progress is not None and not self._closed:
            self._progress.console.print(message, markup=False, highlight=False)
            return
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(f"{message}\n")
        stream.flush()

    # -- plain mode --
    def _eta(self, now: float) -> str:
        done = (self._step or 0) - (self._first_step or 0)
        if done <= 0:
            return "?"
        rate = (now - self._t_first) / done
        return _duration(rate * max(0, self.total_steps - (self._step or 0)))

    def _print_line(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        parts = [f"step {self._step}/{self.total_steps}"]
        stats = format_metrics(self._metrics)
        if stats:
            parts.append(stats)
        parts.append(f"eta {self._eta(now)}")
        if self.logger is not None:
            self.logger.info(" | ".join(parts))
        else:
            self.stream.write(" | ".join(parts) + "\n")
            self.stream.flush()
        self._printed_step = self._step
        self._next_step = self._step + self._every
        self._next_time = now + self.plain_interval_s

    # -- rich mode --
    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class MetricsColumn(ProgressColumn):
            """Formats the latest metrics at render time, on rich's refresh thread."""

            def render(self, task) -> Text:
                text = format_metrics(task.fields.get("metrics", {}))
                return Text(text, no_wrap=True, overflow="ellipsis")

        console = Console(file=self.stream, force_terminal=True)
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            MetricsColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=self.refresh_per_second,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=self.total_steps, metrics={})
        self._replace_handlers(console)  # before the bar proxies sys.stdout and sys.stderr
        try:
            self._progress.start()
        except BaseException:
            self._restore_handlers()
            raise

    # -- a logger's terminal handlers while the rich bar is live --
    def _replace_handlers(self, console) -> None:
        """Each handler of the logger (and of the loggers it propagates to) that writes to the
        bar's terminal is replaced by one that prints above the bar."""
        logger = self.logger
        while logger is not None:
            for index, handler in enumerate(logger.handlers):
                if _writes_to(handler, self.stream):
                    above = _AboveTheBar(console, handler)
                    logger.handlers[index] = above
                    self._replaced.append((logger, handler, above))
            logger = logger.parent if logger.propagate else None

    def _restore_handlers(self) -> None:
        for logger, handler, above in self._replaced:
            if above in logger.handlers:
                logger.handlers[logger.handlers.index(above)] = handler
        self._replaced = []


def _writes_to(handler: logging.Handler, terminal: IO[str]) -> bool:
    """Whether ``handler`` writes to ``terminal``: that stream, or another terminal (one process
    writing to two terminals at once is as good as unheard of)."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    stream = getattr(handler, "stream", None)
    return stream is terminal or (stream is not None and _is_terminal(stream))


class _AboveTheBar(logging.Handler):
    """Prints what ``replaced`` would have written on the live bar's console: the console
    clears the bar, writes the line and draws the bar again. Same level, filters, format."""

    def __init__(self, console, replaced: logging.Handler) -> None:
        super().__init__(replaced.level)
        self.console, self.replaced = console, replaced
        self.filters = list(replaced.filters)
        self.setFormatter(replaced.formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, emoji=False,
                               soft_wrap=True)  # a long line wraps as the terminal does
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)
