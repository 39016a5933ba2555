"""A dependency-free progress line on stderr: done/total, rate and ETA. On a terminal one line rewritten in place;
into a file or a pipe, a plain line every 10 seconds."""

import sys
import time


class Progress:
    def __init__(self, label: str, total: float | None, unit: str = "tokens", stream=sys.stderr, every: float = 0.5):
        self.label, self.total, self.unit, self.stream = label, total, unit, stream
        self.tty = stream.isatty()
        self.every = every if self.tty else max(every, 10.0)
        self.done, self.t0, self.last = 0.0, time.perf_counter(), 0.0

    def update(self, n: float, done: float | None = None) -> None:
        """Add `n` units; `done` (same scale as total) overrides the fraction used for the ETA."""
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._print(now, done)

    def _print(self, now: float, done: float | None, end: str = "") -> None:
        el = max(now - self.t0, 1e-9)
        rate = self.done / el
        line = f"{self.label}: {self.done:,.0f} {self.unit}, {rate:,.{0 if rate >= 10 else 2}f} {self.unit}/s"
        frac = (done if done is not None else self.done) / self.total if self.total else None
        if frac:
            line += f", {min(frac, 1):.0%}, ETA {max(el / frac - el, 0):.0f} s"
        self.stream.write(f"\r{line}   {end}" if self.tty else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        self._print(time.perf_counter(), self.total, end="\n")
