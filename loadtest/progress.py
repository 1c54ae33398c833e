"""What the matrix runner shows while it runs: the cell, its phase, live request counts, an ETA."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Prints one header per cell, one line per phase and a live line during the load.

    On a terminal the live line rewrites itself; otherwise (a log file, CI) it prints a line every
    ``every_s`` seconds.
    """

    def __init__(self, total_cells: int, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.total = total_cells
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self.started = time.monotonic()
        self.done = 0
        self.cell_started = self.started
        self._last_line = 0.0

    def _print(self, text: str, end: str = "\n") -> None:
        self.stream.write(text + end)
        self.stream.flush()

    def cell(self, policy: str, users: int, mix: str) -> None:
        self.cell_started = time.monotonic()
        elapsed = self.cell_started - self.started
        eta = ""
        if self.done:
            remaining = elapsed / self.done * (self.total - self.done)
            eta = f", about {_clock(remaining)} left"
        self._print(
            f"[{self.done + 1}/{self.total}] policy={policy} users={users} mix={mix} "
            f"(elapsed {_clock(elapsed)}{eta})"
        )

    def phase(self, text: str) -> None:
        self._print(f"    {_clock(time.monotonic() - self.cell_started)} {text}")

    def live(self, records: Path, started: float, run_time_s: float) -> None:
        """A status line from the records file so far (call it every second or so)."""
        now = time.monotonic()
        if not self.tty and now - self._last_line < self.every_s:
            return
        self._last_line = now
        count = failures = tokens = 0
        if records.exists():
            for line in records.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line still being written
                count += 1
                failures += 1 if row.get("error") else 0
                tokens += int(row.get("output_tokens", 0))
        elapsed = now - started
        phase = "load" if elapsed <= run_time_s else "finishing running requests"
        text = (
            f"    {phase} {elapsed:5.0f}/{run_time_s:.0f} s: {count} requests done ({failures} failed), "
            f"{tokens} output tokens, {tokens / max(elapsed, 1e-9):.1f} tok/s"
        )
        if self.tty:
            self._print("\r" + text.ljust(110), end="")
        else:
            self._print(text)

    def end_live(self) -> None:
        if self.tty:
            self._print("")

    def cell_done(self, summary: str) -> None:
        self.done += 1
        self._print(f"    {_clock(time.monotonic() - self.cell_started)} done: {summary}")
