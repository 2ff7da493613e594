"""Chunked prefill's policy (`BatchScheduler._step`): how many prompt rows a step takes beside its decoding
rows. Steps are timed as the server runs (`StepTimes`: a line in the step's rows); a step with prompt rows may take
about PREFILL_STALL decoding-only steps (`prefill_room`), more where more requests are starting than decoding
(`prefill_stall`)."""

from __future__ import annotations

PREFILL_STALL = 1.75  # a step with prompt rows beside decoding ones takes about this many decoding-only steps
PREFILL_FIRST = 64  # prompt rows beside decoding ones before the steps have been timed
PREFILL_LEAST = 8  # and at least these, so that a prompt always moves on
EMA = 0.05  # weight of the newest step in the steps' timings


class StepTimes:
    """A step's seconds as a line in its rows, t = fixed + per_row x rows, fitted by least squares over the
    steps timed, the older ones weighing less (EMA): the fixed part is what any step reads (the weights, the
    experts of a layer's union), the per-row part its rows' compute, a prompt's row or a decoding one's."""

    def __init__(self) -> None:
        self.w = self.n = self.t = self.nn = self.nt = 0.0

    def add(self, rows: int, seconds: float) -> None:
        keep = 1 - EMA
        self.w, self.n, self.t = keep * self.w + 1, keep * self.n + rows, keep * self.t + seconds
        self.nn, self.nt = keep * self.nn + rows * rows, keep * self.nt + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a row); None until steps of different sizes say it (or where they say a row
        costs nothing)."""
        if self.w < 2:
            return None
        mn, mt = self.n / self.w, self.t / self.w
        var = self.nn / self.w - mn * mn
        if var < 1.0:  # rows hardly varied: no slope to read
            return None
        per_row = (self.nt / self.w - mn * mt) / var
        return (max(mt - per_row * mn, 0.0), per_row) if per_row > 0 else None


def prefill_stall(starting: int, decoding: int) -> float:
    """The decoding-only steps a step may take with the prompts of `starting` requests beside `decoding` ones:
    PREFILL_STALL, times how many times the starting outnumber the decoding. Each decoding one waits the extra
    once, each starting one gets its first token sooner: many starting beside few go in nearly whole."""
    return PREFILL_STALL * max(1.0, starting / max(decoding, 1))


def prefill_room(fit: tuple[float, float] | None, decoding: int, stall: float = PREFILL_STALL) -> int:
    """Prompt rows a step takes beside `decoding` rows (chunked prefill): those that keep the step within
    `stall` times a step of the decoding rows alone, by `StepTimes.fit`; PREFILL_FIRST before the steps say,
    at least PREFILL_LEAST."""
    if fit is None:
        return PREFILL_FIRST
    fixed, per_row = fit
    return max(PREFILL_LEAST, int((stall - 1) * (fixed + per_row * decoding) / per_row))
