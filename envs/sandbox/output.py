"""Bounded capture of a command's output streams.

Every stream is read to its end (so a writer never blocks on a full pipe) but only the first
``cap`` bytes are kept; the rest is counted and replaced by a marker. Memory stays bounded
however much a command prints.
"""

from __future__ import annotations


class Capped:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    __slots__ = ("cap", "data", "dropped")

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[... output truncated: {self.dropped} bytes dropped ...]"
        return out


class Marked(Capped):
    """A ``Capped`` stream that ends at ``marker``: what follows it is not the command's output.

    The persistent shell writes an unguessable marker after each command; bytes after it
    (a killed background process's last write) are discarded. ``seen`` turns true at the marker.
    """

    __slots__ = ("marker", "seen", "_tail")

    def __init__(self, cap: int, marker: bytes) -> None:
        super().__init__(cap)
        self.marker, self.seen, self._tail = marker, False, b""

    def add(self, chunk: bytes) -> None:
        if self.seen:
            return
        buf = self._tail + chunk
        at = buf.find(self.marker)
        if at >= 0:
            self.seen = True
            super().add(buf[:at])
            return
        keep = len(self.marker) - 1  # a marker may straddle two chunks
        if len(buf) > keep:
            super().add(buf[: len(buf) - keep])
            self._tail = buf[len(buf) - keep :]
        else:
            self._tail = buf

    def flush(self) -> None:
        """The stream ended without a marker: what was held back is output too."""
        if not self.seen and self._tail:
            super().add(self._tail)
            self._tail = b""
