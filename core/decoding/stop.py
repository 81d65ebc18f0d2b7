"""Stop strings over streamed text (pure Python): what is safe to show, and where to cut."""

from __future__ import annotations


class StopMatcher:
    """Streams text while holding back any tail that could begin a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now."""
        buf = self._pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            self.stopped = True
            self._pending = ""
            at, self.matched = min(hits)
            return buf[:at]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
