"""The frames the stream's producer processes and the training thread exchange (``_feed/pipes.py``)."""

from __future__ import annotations

import os
import threading

import pytest

from mmbuffer._feed.pipes import Inbox, send_message, send_number


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_frames_come_out_whole_and_in_order_whatever_the_reads_cut(pipe):
    r, w = pipe
    box = Inbox(r)
    assert box.take() is None and not box.has_frame()  # nothing yet: no wait, no frame
    send_number(w, 0)
    send_message(w, b"")
    send_number(w, 2**31 - 1)
    send_message(w, b"E" + b"x" * 100)
    assert box.has_frame() is False  # nothing read yet: has_frame never reads
    assert box.take() == 0  # one read brought every frame in
    assert box.has_frame()
    assert [box.take(), box.take(), box.take(), box.take()] == [b"", 2**31 - 1, b"E" + b"x" * 100, None]
    # a frame written in two parts (a header, then its body) is not taken until whole
    frame = (-6).to_bytes(4, "little", signed=True) + b"hello"  # -(5 + 1): five bytes follow
    os.write(w, frame[:3])
    assert box.take() is None
    os.write(w, frame[3:6])
    assert box.take() is None and not box.has_frame()
    os.write(w, frame[6:])
    assert box.take() == b"hello"


def test_a_message_longer_than_the_pipe_holds_arrives_whole(pipe):
    r, w = pipe
    box = Inbox(r)
    big = os.urandom(1 << 20)  # 16 times a pipe's buffer: the writer blocks until read
    writer = threading.Thread(target=send_message, args=(w, big))
    writer.start()
    got = None
    while got is None:
        got = box.take()
    writer.join()
    assert got == big


def test_a_closed_writer_is_end_of_file_after_the_frames_it_sent(pipe):
    r, w = pipe
    box = Inbox(r)
    send_number(w, 3)
    os.write(w, b"\x01\x00")  # half a header, then the writer dies
    os.close(w)
    assert box.take() == 3
    with pytest.raises(EOFError):
        box.take()
