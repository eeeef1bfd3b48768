"""A minimal progress bar for long work: silent for the first second, then a bar that redraws
in place on a terminal (or a line every few seconds when output is a file or a pipe)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "training") as bar: bar.update(i + 1, "loss 0.12")``."""

    def __init__(self, total: int, label: str, stream=None, delay: float = 1.0, width: int = 30):
        self.total, self.label, self.delay, self.width = max(total, 1), label, delay, width
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.shown = False
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, done: int, note: str = "") -> None:
        now = time.monotonic()
        if now - self.start < self.delay and done < self.total:
            return
        if now - self.last_draw < (0.1 if self.tty else 2.0) and done < self.total:
            return
        self.last_draw = now
        self.shown = True
        filled = int(self.width * done / self.total)
        bar = "█" * filled + "░" * (self.width - filled)
        line = f"  {self.label} {bar} {done}/{self.total} {note}"
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()
