"""Rate-limited logging: a few lines per kind of event per interval, and a count of the rest.

Why: what a node logs about its peers -- a refused envelope, a member turning alive or dead -- happens as often as
a peer (or an attacker holding the secret) makes it happen. One line per event let 10,000 fake members write
~20,000 INFO lines per node, and 1,000 garbage calls ~5,800 lines. A limiter per event kind keeps the first
``burst`` lines of each ``interval_s`` (enough to see what is going on, and the first occurrence is never lost),
counts the others, and says how many it held back on the next line of that kind or at ``flush()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2pnode.config import LOG_LIMIT_BURST, LOG_LIMIT_INTERVAL_S, LOG_LIMIT_MAX_KINDS

#: The kind every event falls into once ``LOG_LIMIT_MAX_KINDS`` kinds are tracked (kinds come from peers).
OTHER_KIND = "(other)"


@dataclass(slots=True)
class _Window:
    start: float
    emitted: int = 0
    suppressed: int = 0


class LogLimiter:
    """At most ``burst`` lines per kind per ``interval_s`` to ``logger`` (see the module docstring)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = LOG_LIMIT_BURST,
        interval_s: float = LOG_LIMIT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        #: Lines held back since this limiter was made (every kind).
        self.suppressed_total = 0

    def log(self, level: int, kind: str, msg: str, *args: object, extra: dict[str, object] | None = None) -> bool:
        """Log ``msg % args`` (with the record's ``extra`` fields) unless this kind used its burst in the current
        interval; True when it was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        if kind not in self._windows and len(self._windows) >= LOG_LIMIT_MAX_KINDS:
            self.flush(level)  # kinds whose interval is over make room (a limiter nobody flushes fills up once)
            if len(self._windows) >= LOG_LIMIT_MAX_KINDS:
                kind = OTHER_KIND
        window = self._windows.get(kind)
        held = 0
        if window is None or now - window.start >= self.interval_s:
            held = window.suppressed if window is not None else 0
            window = self._windows[kind] = _Window(now)
        if window.emitted >= self.burst:
            window.suppressed += 1
            self.suppressed_total += 1
            return False
        window.emitted += 1
        if held:
            msg += " (%d similar line(s) held back in the previous %.0f s)"
            args = (*args, held, self.interval_s)
        self.logger.log(level, msg, *args, extra=extra)
        return True

    def warning(self, kind: str, msg: str, *args: object, extra: dict[str, object] | None = None) -> bool:
        return self.log(logging.WARNING, kind, msg, *args, extra=extra)

    def info(self, kind: str, msg: str, *args: object, extra: dict[str, object] | None = None) -> bool:
        return self.log(logging.INFO, kind, msg, *args, extra=extra)

    def flush(self, level: int = logging.INFO) -> None:
        """Report and forget the kinds whose interval is over and that held lines back (call it now and then)."""
        now = self.clock()
        for kind, window in list(self._windows.items()):
            if now - window.start < self.interval_s:
                continue
            if window.suppressed:
                self.logger.log(
                    level, "%d more line(s) of kind %r held back in the last %.0f s", window.suppressed, kind,
                    self.interval_s,
                )
            del self._windows[kind]
