"""Text of a generation as its tokens arrive: incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Detokenises a growing list of ids, cuts at the first stop string, and says which new text is
    safe to stream: text that could still turn into a stop string, or an incomplete UTF-8 character
    (U+FFFD at the end), is held back until the next token settles it.

    Each token costs work in proportion to the few tokens since the text last settled, not to the
    whole generation: only a window is decoded, from the last settled token but one (it gives the
    decoder its context, such as whether a word starts with a space), and the new text is what the
    window adds to that token's own text. Stop strings are looked for only where they could end in
    the new text."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: the token before the settled ones
        self._read = 0  # ids before this are settled: their text is `_settled`
        self._settled = ""
        self.text = ""  # all text so far (cut at the stop string once one is found)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Take one token; returns the text that may be streamed now. Sets `stopped` at a stop string."""
        self._ids.append(token_id)
        context = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        pending = window[len(context):]
        scan_from = max(0, len(self._settled) - self._longest + 1)  # earlier text held no stop string
        self.text = self._settled + pending
        if pending and not pending.endswith("\ufffd"):  # settled: the next window starts here
            self._settled = self.text
            self._prefix, self._read = self._read, len(self._ids)
        hits = [i for i in (self.text.find(s, scan_from) for s in self._stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held())

    def finish(self) -> str:
        """Whatever was held back, once generation has ended."""
        return self._take(len(self.text))

    def _held(self) -> int:
        """Characters at the end of `text` that must wait."""
        if self.text.endswith("\ufffd"):
            return len(self.text) - len(self.text.rstrip("\ufffd"))
        held = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _take(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
