"""Framed messages on the raw file descriptor of a ``multiprocessing`` pipe.

The stream's producer processes and the training thread exchange small messages (a
slot number each way per batch). ``Connection.poll`` builds a selector per call and
``recv_bytes`` reads a message in two reads and a buffer: 8 µs a poll where an
``os.read`` takes 2 (the dev VM, tight loop), and several times that on a training
thread between steps. Here a frame is one write and usually one read:

* a little-endian int32 ``h``; ``h >= 0`` is a number (a slot) and nothing follows;
* ``h < 0`` is followed by ``-h - 1`` bytes (a message: "ready", an error).

:class:`Inbox` reads what has arrived without blocking when its descriptor is
non-blocking (the training thread's side) and keeps what it read past a frame.

>>> import os
>>> r, w = os.pipe()
>>> os.set_blocking(r, False)
>>> send_number(w, 7); send_message(w, b"hello")
>>> box = Inbox(r)
>>> box.take(), box.take(), box.take()
(7, b'hello', None)
>>> os.close(w)
>>> box.take()
Traceback (most recent call last):
    ...
EOFError: the other end closed the pipe
"""

from __future__ import annotations

import os
import struct

__all__ = ["Inbox", "send_message", "send_number"]

_HEADER = struct.Struct("<i")
_READ = 1 << 16  # bytes asked for per read: frames that arrived together come in one


def send_number(fd: int, number: int) -> None:
    """Send ``number`` (``0 <= number < 2**31``) as one frame."""
    _write_all(fd, _HEADER.pack(number))


def send_message(fd: int, data: bytes) -> None:
    """Send ``data`` as one frame (one write when it fits the pipe's atomic size)."""
    _write_all(fd, _HEADER.pack(-len(data) - 1) + data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Inbox:
    """The frames arriving on ``fd``, in order."""

    __slots__ = ("_buffer", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()

    def take(self) -> int | bytes | None:
        """The next frame (a number or a message's bytes), or None if none has
        arrived whole yet (a non-blocking descriptor; a blocking one waits for data).
        ``EOFError`` once the other end has closed and no whole frame is left."""
        end = self._whole()
        if not end:
            try:
                got = os.read(self.fd, _READ)
            except BlockingIOError:
                return None
            if not got:
                raise EOFError("the other end closed the pipe")
            self._buffer += got
            end = self._whole()
            if not end:
                return None
        buffer = self._buffer
        head = _HEADER.unpack_from(buffer)[0]
        frame: int | bytes = head if head >= 0 else bytes(buffer[_HEADER.size : end])
        del buffer[:end]
        return frame

    def has_frame(self) -> bool:
        """Whether a whole frame is already read and waiting."""
        return self._whole() > 0

    def _whole(self) -> int:
        """The length of the first frame if it has arrived whole, else 0."""
        buffer = self._buffer
        if len(buffer) < _HEADER.size:
            return 0
        end = _HEADER.size + max(-_HEADER.unpack_from(buffer)[0] - 1, 0)
        return end if len(buffer) >= end else 0
