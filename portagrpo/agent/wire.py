"""Messages across the tool sandbox's trust boundary: length-framed JSON, with file descriptors where asked.

Whatever a tool process may be able to write is read here as data: a 4-byte big-endian length, then that many
bytes of UTF-8 JSON. Nothing is unpickled, so a forged message (a pickle whose `__reduce__` runs a command, as a
`multiprocessing.Connection` would run it) is at worst a malformed message: `WireError`, which the reader treats as a
failed call. Descriptors travel as SCM_RIGHTS on the frame's first bytes (the trainer hands a call's job pipe to its
worker that way, so the worker never reads the job).
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a result is capped far below this (Limits.max_output_bytes); more is a malformed message
MAX_FDS = 4


class WireError(ValueError):
    """A message that is not one: oversized, cut short, not UTF-8 JSON, or not the shape its reader expects."""


def send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Send `message` (JSON-able) as one frame, with `fds` attached to its first bytes."""
    data = json.dumps(message, separators=(",", ":"), default=str).encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(f"a message of {len(data)} bytes is over the {MAX_MESSAGE}-byte limit")
    frame = HEADER.pack(len(data)) + data
    sent = 0
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([frame], ancillary)
    if sent < len(frame):
        sock.sendall(frame[sent:])


CHUNK = 1 << 20  # bytes asked of one recvmsg: a huge frame is read in pieces, never one buffer of its whole size


def _read_exactly(sock: socket.socket, size: int, fds: list[int], deadline: float | None,
                  at_start: bool = False) -> bytes:
    chunks, got = [], 0
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while got < size:
        if deadline is not None:  # one deadline for the whole frame: a sender that trickles bytes runs out of it
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError("the message did not arrive whole in time")
            sock.settimeout(left)
        data, ancillary, msg_flags, _ = sock.recvmsg(min(size - got, CHUNK), space, flags)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[:len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if msg_flags & getattr(socket, "MSG_CTRUNC", 0):
            raise WireError("more descriptors than a message may carry")
        if not data:
            if got == 0 and at_start:
                raise EOFError("the peer closed the connection")
            raise WireError("the message was cut short")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout_s: float | None = None) -> tuple[Any, list[int]]:
    """One frame: (the decoded JSON value, the descriptors it carried). EOFError at a clean end; WireError for
    anything that is not a frame of JSON, or, with `timeout_s`, one not whole within that many seconds of its start
    (the descriptors that came with it are closed)."""
    fds: list[int] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        (size,) = HEADER.unpack(_read_exactly(sock, HEADER.size, fds, deadline, at_start=True))
        if size > MAX_MESSAGE:
            raise WireError(f"a message of {size} bytes is over the {MAX_MESSAGE}-byte limit")
        body = _read_exactly(sock, size, fds, deadline)
        try:
            return json.loads(body.decode("utf-8")), fds
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise WireError(f"not a JSON message ({type(err).__name__})") from None
    except TimeoutError:
        for fd in fds:
            os.close(fd)
        raise WireError("the message did not arrive whole in time") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if deadline is not None:
            sock.settimeout(None)


def expect(message: Any, kind: str, *fields: str) -> dict:
    """`message` as a dict of kind `kind` with every field named, or WireError."""
    if not isinstance(message, dict) or message.get("kind") != kind or any(f not in message for f in fields):
        raise WireError(f"expected a {kind!r} message with {', '.join(fields) or 'no fields'}")
    return message
