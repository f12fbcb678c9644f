"""The built-in engine's load, logged over fixed windows: is the engine the bottleneck, or idle waiting for requests?

`LoadMeter` adds up, per window, the seconds the scheduler spent in steps (the rest it waited for work or
ran commands), the part of them spent prefilling, the seconds its commands took (refits, pauses), the rows it
prefilled and the tokens its decode steps sampled; every `WINDOW_S` the engine logs one line: tokens/s, busy
share, mean rows per decode step, the step's milliseconds with and without its prefills, prefills per second
and the commands' share. A busy share near 100% says the engine bounds the rollout; a low one says the
requests do not come fast enough (the rollout, the router, the envs, or a staleness bound upstream). The
prefill split says whether a slow step is the decode or the newcomers (and the rows a refit re-prefills).
"""

import time
from dataclasses import dataclass, field

WINDOW_S = 30.0


@dataclass
class LoadMeter:
    """Counters of the current window."""

    window_s: float = WINDOW_S
    start: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    steps: int = 0
    decoded: int = 0
    """Tokens sampled by decode steps (rows x steps)."""
    prefilled: int = 0
    """Rows prefilled (each samples its first token)."""
    prefills: int = 0
    prefill_s: float = 0.0
    """Seconds of the steps spent admitting newcomers (their prefill, first token and join)."""
    command_s: float = 0.0
    """Seconds spent running commands between steps (refits, pauses, submissions)."""

    def add(self, seconds: float, prefilled: int, decoded: int, prefill_s: float = 0.0) -> None:
        self.busy_s += seconds
        self.prefill_s += prefill_s
        self.steps += 1
        self.decoded += decoded
        self.prefilled += prefilled
        self.prefills += prefilled > 0

    def take(self, now: float | None = None) -> dict[str, float] | None:
        """The finished window's figures (and a new window), or None while the window runs."""
        now = time.monotonic() if now is None else now
        span = now - self.start
        if span < self.window_s:
            return None
        decode_steps = max(1, self.steps)
        out = {
            "tokens_per_s": (self.decoded + self.prefilled) / span,
            "busy": self.busy_s / span,
            "rows_per_step": self.decoded / decode_steps,
            "prefills_per_s": self.prefills / span,
            "ms_per_step": 1000 * self.busy_s / decode_steps,
            "decode_ms_per_step": 1000 * (self.busy_s - self.prefill_s) / decode_steps,
            "prefill_share": self.prefill_s / self.busy_s if self.busy_s > 0 else 0.0,
            "commands": self.command_s / span,
        }
        self.start, self.busy_s, self.steps, self.decoded, self.prefilled, self.prefills = now, 0.0, 0, 0, 0, 0
        self.prefill_s = self.command_s = 0.0
        return out


def load_line(figures: dict[str, float]) -> str:
    return (
        "load: {tokens_per_s:.0f} tok/s, busy {busy:.0%}, {rows_per_step:.1f} rows/step, "
        "{ms_per_step:.2f} ms/step ({decode_ms_per_step:.2f} without prefills), {prefills_per_s:.1f} prefills/s "
        "({prefill_share:.0%} of busy), commands {commands:.0%}".format(**figures)
    )
