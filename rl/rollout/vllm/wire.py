"""The framing between ``VLLMEngine`` (the driver's environment) and its engine process (the vLLM
venv's interpreter, ``venv/serve.py``): one message is a 4-byte big-endian length and a pickle of
plain Python values (dicts of str, int, float, lists of them; no tensors, no classes of ours), so
the two interpreters need only the same Python, not the same torch or the same packages.

Standard library only: the engine process imports this file as a top-level module."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_LEN = struct.Struct(">I")


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection (or died)."""
    head = _read(sock, _LEN.size)
    if head is None:
        return None
    body = _read(sock, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (ConnectionResetError, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
