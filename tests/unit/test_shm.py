"""The shared-memory arena and hand-over (``ltx_mgpu.wire.arena``, ``sender``, ``receiver``) between a
sender and a receiver on a socket pair: round trips, reuse, acknowledgement, hand-over of spares,
and every malformed frame refused naming its rule without leaking a descriptor."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import threading
import time

import pytest
import torch
from pool_support import assert_same_tensors, socket_pair

from ltx_mgpu import wire
from ltx_mgpu.wire import arena
from ltx_mgpu.wire import sender as arena_sender
from ltx_mgpu.wire.frames import ProtocolError
from ltx_mgpu.wire.receiver import ArenaReceiver
from ltx_mgpu.wire.sender import ArenaSender


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _arena_pair(min_bytes=1 << 16, take=None):
    a, b = socket_pair()
    return a, b, ArenaSender(arena.Budget(), min_bytes=min_bytes), ArenaReceiver(take)


def _send_then_recv(a, b, sender, receiver, tensors, header=None):
    t = threading.Thread(target=wire.send_frame, args=(a, header or {"event": "x"},
                                                           wire.tensors_to_payload(tensors)),
                         kwargs={"shm": sender}, daemon=True)
    t.start()
    out = wire.recv_frame(b, shm=receiver)
    t.join()
    return out


def test_arena_frames_round_trip_reuse_the_arena_and_replace_it_when_too_small():
    a, b, sender, receiver = _arena_pair()
    with a, b:
        small = {"t": torch.arange(10)}
        _, got = _send_then_recv(a, b, sender, receiver, small)
        assert_same_tensors(got, small)
        assert receiver.frames == 0  # under min_bytes: the socket
        big = {"x": torch.randn(300, 257), "y": torch.randn(100, 33).bfloat16(), "e": torch.zeros(0, 4)}
        for k in range(3):
            header, got = _send_then_recv(a, b, sender, receiver, big, {"event": "x", "k": k})
            assert header == {"event": "x", "k": k}  # the shm reference is consumed by the frame layer
            assert_same_tensors(got, big)
            assert not any(receiver.arena.holds(t) for t in got.values())  # copies of their own
        assert (receiver.frames, receiver.arenas, sender.seq) == (3, 1, 3)  # one warm arena, reused
        bigger = {"z": torch.randn(1000, 1000)}
        _, got = _send_then_recv(a, b, sender, receiver, bigger)
        assert_same_tensors(got, bigger)
        assert receiver.arenas == 2 and receiver.arena.size >= 4_000_000
        sender.close()
        receiver.drop()


def test_receive_reads_straight_from_the_arena_and_results_left_in_it_are_copied():
    seen = []

    def take(header):
        return None if header.get("plain") else lambda name, view: seen.append(name) or (
            view.float() if view.dtype == torch.bfloat16 else view)

    a, b, sender, receiver = _arena_pair(take=take)
    with a, b:
        x = torch.randn(512, 300)
        want = {"bf": x.bfloat16(), "f32": x}
        _, got = _send_then_recv(a, b, sender, receiver, want)
        assert sorted(seen) == ["bf", "f32"]
        assert got["bf"].dtype == torch.float32 and torch.equal(got["bf"], x.bfloat16().float())  # exact upcast
        assert torch.equal(got["f32"], x) and not receiver.arena.holds(got["f32"])  # the view was copied out
        _, again = _send_then_recv(a, b, sender, receiver, {"bf": torch.zeros(512, 300).bfloat16()})
        assert torch.equal(got["bf"], x.bfloat16().float())  # the arena's reuse leaves earlier results alone
        _, plain = _send_then_recv(a, b, sender, receiver, want, {"event": "x", "plain": True})
        assert_same_tensors(plain, want)
        sender.close()
        receiver.drop()


def test_an_unacknowledged_arena_is_not_overwritten_the_socket_carries_the_next_payload():
    a, b, sender, receiver = _arena_pair()
    with a, b:
        first, second = {"t": torch.full((200, 200), 1.0)}, {"t": torch.full((200, 200), 2.0)}
        wire.send_frame(a, {"event": "x"}, wire.tensors_to_payload(first), shm=sender)
        wire.send_frame(a, {"event": "x"}, wire.tensors_to_payload(second), shm=sender)
        assert sender.frames == 1  # the receiver has not read the first one yet
        assert_same_tensors(wire.recv_frame(b, shm=receiver)[1], first)
        assert_same_tensors(wire.recv_frame(b, shm=receiver)[1], second)
        assert sender.idle(now=time.monotonic() + sender.idle_seconds)  # acknowledged and idle
        wire.send_frame(a, {}, flags=wire.FLAG_SHM_DROP)
        wire.send_frame(a, {"event": "x"}, None)
        assert wire.recv_frame(b, shm=receiver) == ({"event": "x"}, {})  # the notice is consumed
        assert receiver.arena is None
        sender.close()


def _assert_refused(a, b, receiver, flags: int, header: dict, fds: list[int], match: str) -> None:
    """Send a hand-made frame (``flags``, ``header``, no payload, ``fds`` attached and then
    closed on this side) on ``a`` and check that ``receiver`` refuses it on ``b`` naming ``match``."""
    raw = json.dumps(header).encode()
    arena.send_with_fds(a, struct.pack("!4sHHIQ", wire.MAGIC, wire.PROTOCOL_VERSION, flags, len(raw), 0) + raw,
                      fds)
    for f in fds:
        os.close(f)
    b.settimeout(10)
    with pytest.raises(ProtocolError, match=re.escape(match)):
        wire.recv_frame(b, shm=receiver)


def _memfd(size=1 << 20, seal=True) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _ref(arena=1, seq=99, offset=64, size=100):
    return {"arena": arena, "seq": seq, "offset": offset, "size": size}


@pytest.mark.parametrize("flags, header, fd, match", [
    (wire.FLAG_SHM, {"event": "x"}, None, "shm reference must be"),
    (wire.FLAG_SHM, {"event": "x", "shm": {**_ref(), "name": "../../etc/passwd"}}, None, "shm reference must be"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(seq=True)}, None, "shm reference must be"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(offset=-64)}, None, "shm reference must be"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(arena=7)}, None, "refers to arena 7, but this connection maps 1"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(offset=1 << 30)}, None, "not a payload range"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(offset=0)}, None, "not a payload range"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(seq=1)}, None, "sequence number 1 is not after"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref(size=1000)}, None, "not a valid safetensors blob"),
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, None, "0 file descriptor"),
    (wire.FLAG_SHM, {"event": "x", "shm": _ref()}, "memfd", "1 file descriptor(s) came with a frame of flags 0x1"),
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "file", "not a memfd"),
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "pipe", "not a regular"),
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "unsealed", "not sealed"),
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "five", "too many file"),
    # sparse and far larger than any payload: refused before it is mapped (and populated)
    (wire.FLAG_SHM | wire.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "huge", "more than a"),
    (wire.FLAG_SHM_DROP, {"event": "x"}, None, "drop notice must have an empty header"),
    (wire.FLAG_SHM_DROP | wire.FLAG_SHM, {}, None, "not a valid combination"),
    (0x8, {"event": "x"}, None, "unknown frame flags 0x8"),
])
def test_broken_shm_frames_are_refused_naming_the_rule_and_leak_no_descriptor(tmp_path, flags, header, fd, match):
    a, b, sender, receiver = _arena_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"t": torch.randn(200, 200)})  # arena 1 mapped, seq 1
        before = _fd_count()
        fds = []
        if fd in ("memfd", "unsealed"):
            fds = [_memfd(seal=fd == "memfd")]
        elif fd == "file":
            (tmp_path / "f").write_bytes(b"\0" * 4096)
            fds = [os.open(tmp_path / "f", os.O_RDONLY)]
        elif fd == "pipe":
            r, w = os.pipe()
            os.close(w)
            fds = [r]
        elif fd == "five":
            fds = [_memfd() for _ in range(5)]
        elif fd == "huge":
            fds = [_memfd(size=16 << 30)]
        _assert_refused(a, b, receiver, flags, header, fds, match)
        assert _fd_count() <= before  # what came with the frame was closed
        sender.close()
        receiver.drop()




# --------------------------------------------------------------------------- hand-over (shm_own)

def _own_pair(take=None, own_min_bytes=1 << 18):
    a, b = socket_pair()
    sender = ArenaSender(arena.Budget(), min_bytes=1 << 16, own=True, own_min_bytes=own_min_bytes)
    return a, b, sender, ArenaReceiver(take)


def _spare_made(sender):
    if sender._making is not None:
        sender._making.join(timeout=30)


def test_a_ready_spare_is_handed_over_the_receiver_keeps_views_of_it_and_the_sender_lets_go():
    a, b, sender, receiver = _own_pair()
    with a, b:
        first = {"x": torch.randn(512, 512)}  # 1 MiB: no spare yet, the connection's arena carries it
        _, got = _send_then_recv(a, b, sender, receiver, first)
        assert_same_tensors(got, first)
        assert (receiver.owned, receiver.arenas) == (0, 1)
        _spare_made(sender)  # made in the background after that first large payload
        kept = []
        for k in range(3):
            want = {"x": torch.randn(512, 512), "y": torch.arange(1000)}
            before = _fd_count()
            _, got = _send_then_recv(a, b, sender, receiver, want, {"event": "x", "k": k})
            assert_same_tensors(got, want)
            assert not receiver.arena.holds(got["x"])  # not the connection's arena: memory of its own
            kept.append((got, want))
            _spare_made(sender)
            # the sender closed the handed-over descriptor, the receiver its copy: the one open
            # descriptor of a spare is the next spare's
            assert _fd_count() == before
        assert receiver.owned == 3 and sender.handed == 3 and receiver.arenas == 1
        sender.close()
        receiver.drop()
        for got, want in kept:  # the mappings live on with the tensors
            assert_same_tensors(got, want)
            got["x"].zero_()  # and are the receiver's to write
        assert sender.budget.used == 0  # nothing handed over counts against the pool's budget


def test_the_next_spare_is_made_after_the_frame_is_sent_not_before(monkeypatch):
    """A large payload's next spare (a thread start and its pages) is started once the frame is
    out (sent), so it never delays the frame; a frame that could not be sent (unsent) starts it
    too, and a payload that went through the socket starts it at once."""
    a, b, sender, receiver = _own_pair()
    starts = []
    real = sender._make_spare_soon
    monkeypatch.setattr(sender, "_make_spare_soon", lambda need: starts.append(need) or real(need))
    payload = wire.tensors_to_payload({"x": torch.randn(512, 512)})
    with a, b:
        placed = sender.place(payload)
        assert placed is not None and starts == []  # placed: nothing started yet
        sender.sent()
        assert starts == [arena.HEADER_BYTES + payload.nbytes]
        sender.sent()  # once per placed frame
        assert len(starts) == 1
        _spare_made(sender)
        assert sender.place(payload) is not None and len(starts) == 1  # handed over: the next one after the send
        sender.unsent()
        assert len(starts) == 2
        _spare_made(sender)
        sender.arena.ack[0] = sender.seq - 1  # the receiver has not acknowledged: the socket carries it
        sender._spare, spare = None, sender._spare
        sender.budget.release(spare.size)
        spare.close()
        assert sender.place(payload) is None and len(starts) == 3
        _spare_made(sender)
        sender.close()
        receiver.drop()


def test_handed_over_frames_need_no_acknowledgement_and_receive_applies():
    calls = []

    def take(header):
        return lambda name, view: calls.append(name) or (view.float() if view.dtype == torch.bfloat16 else view)

    a, b, sender, receiver = _own_pair(take=take)
    with a, b:
        x = torch.randn(600, 600)
        _send_then_recv(a, b, sender, receiver, {"bf": x.bfloat16(), "f": x})  # through the arena
        calls.clear()
        for k in (1, 2):  # same size: the spare fits; neither is read before both are out
            _spare_made(sender)
            wire.send_frame(a, {"event": "x"}, wire.tensors_to_payload({"bf": (x * k).bfloat16(), "f": x * k}),
                                shm=sender)
        assert sender.handed == 2
        _, one = wire.recv_frame(b, shm=receiver)
        _, two = wire.recv_frame(b, shm=receiver)
        assert torch.equal(one["bf"], x.bfloat16().float()) and torch.equal(one["f"], x)
        assert torch.equal(two["bf"], (x * 2).bfloat16().float()) and torch.equal(two["f"], x * 2)
        assert calls == ["bf", "f", "bf", "f"] and receiver.owned == 2
        sender.close()
        receiver.drop()


def test_a_spare_far_larger_than_the_payload_is_not_handed_over():
    a, b, sender, receiver = _own_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(2048, 1024)})  # 8 MiB: an 8 MiB spare
        _spare_made(sender)
        _, got = _send_then_recv(a, b, sender, receiver, {"x": torch.ones(512, 256)})  # 0.5 MiB
        assert receiver.owned == 0 and torch.equal(got["x"], torch.ones(512, 256))  # the arena carried it
        _spare_made(sender)  # a fitting spare is made instead
        _, got = _send_then_recv(a, b, sender, receiver, {"x": torch.ones(512, 256)})
        assert receiver.owned == 1
        sender.close()
        receiver.drop()


def test_an_idle_sender_drops_its_spare_and_makes_a_new_one_later():
    a, b, sender, receiver = _own_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})
        _spare_made(sender)
        assert sender.holding() and sender.budget.used > 0
        assert sender.idle(now=time.monotonic() + sender.idle_seconds)
        sender.drop()
        assert not sender.holding() and sender.budget.used == 0
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})  # no spare: arena again
        _spare_made(sender)
        _, got = _send_then_recv(a, b, sender, receiver, {"x": torch.ones(512, 512)})
        assert receiver.owned == 1 and torch.equal(got["x"], torch.ones(512, 512))
        sender.close()
        receiver.drop()


def _own(offset=64, size=100, **extra):
    return {"own": True, "offset": offset, "size": size, **extra}


@pytest.mark.parametrize("ref, fds, fd_size, match", [
    (_own(), 0, 256, "0 descriptors came with a handed-over frame"),
    (_own(), 2, 256, "2 descriptors came with a handed-over frame"),
    (_own(seq=3), 1, 256, "handed-over shm reference must be"),
    ({**_own(), "own": 1}, 1, 256, "handed-over shm reference must be"),
    (_own(offset=8), 1, 256, "not a payload range of the"),
    (_own(size=1 << 21), 1, 256, "not a payload range of the"),
    (_own(), 1, 1 << 30, "more than twice what it carries"),  # a sparse 1 GiB file for 164 bytes: never mapped
    (_own(), 1, 256, "handed-over payload is not a valid safetensors blob"),
])
def test_broken_hand_overs_are_refused_naming_the_rule_and_leak_no_descriptor(ref, fds, fd_size, match):
    a, b = socket_pair()
    receiver = ArenaReceiver()
    with a, b:
        before = _fd_count()
        sent = [_memfd(size=fd_size) for _ in range(fds)]
        flags = wire.FLAG_SHM | (wire.FLAG_SHM_FD if fds else 0)
        _assert_refused(a, b, receiver, flags, {"event": "x", "shm": ref}, sent, match)
        assert _fd_count() <= before


def test_a_frame_whose_header_breaks_the_limits_after_placement_leaves_the_arena_in_step():
    a, b, sender, receiver = _arena_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"t": torch.randn(200, 200)})
        seq = sender.seq
        with pytest.raises(ProtocolError, match="header"):
            wire.send_frame(a, {"event": "x", "pad": "x" * 300}, wire.tensors_to_payload({"t": torch.ones(200, 200)}),
                                limits=wire.Limits(max_header_bytes=256), shm=sender)
        assert sender.seq == seq and sender.frames == 1  # undone: the acknowledged arena is reused next
        _, got = _send_then_recv(a, b, sender, receiver, {"t": torch.full((200, 200), 3.0)})
        assert torch.equal(got["t"], torch.full((200, 200), 3.0)) and receiver.frames == 2 and receiver.arenas == 1
        sender.close()
        receiver.drop()


def test_a_spare_being_made_counts_as_held_so_the_idle_check_drops_it_when_it_lands():
    a, b, sender, receiver = _own_pair()
    with a, b:
        gate = threading.Event()
        make = arena_sender._make_arena

        def slow(size):  # the spare's allocation only (the connection's arena uses the same function)
            if threading.current_thread().name == "shm-spare":
                gate.wait(10)
            return make(size)

        arena_sender._make_arena = slow
        try:
            _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})
            sender.drop()  # idle drop while the spare is still being made
            assert sender.arena is None and sender.holding()  # not forgotten: the writer keeps checking
            gate.set()
            _spare_made(sender)
            assert sender.holding() and sender.idle(now=time.monotonic() + sender.idle_seconds)
            sender.drop()
            assert not sender.holding() and sender.budget.used == 0
        finally:
            arena_sender._make_arena = make
        sender.close()
        receiver.drop()


def _reserved_views(sender, specs):
    """What ``JobContext.result_buffers`` makes: the payload's tensors as views of a reservation."""
    from ltx_mgpu.wire.payload import payload_layout

    _, spans = payload_layout(specs)
    region = sender.reserve(max(end for _, end in spans.values()))
    if region is None:
        return None
    return {n: region[slice(*spans[n])].view(d).view(s) for n, d, s in specs}


def test_a_payload_written_in_its_reservation_is_handed_over_without_a_copy(monkeypatch):
    """reserve(): the producer writes the payload where place() would put it; place() then hands
    that memory over without copying it (the copy is refused here), another payload sent
    meanwhile leaves the reservation alone, and the receiver gets the written values."""
    a, b, sender, receiver = _own_pair()
    with a, b:
        x = torch.randn(512, 512)
        _send_then_recv(a, b, sender, receiver, {"x": x})  # through the arena; a spare is made after it
        _spare_made(sender)
        specs = [("prompt_0", torch.float32, (300, 512)), ("prompt_1", torch.float32, (212, 512))]
        views = _reserved_views(sender, specs)
        assert views is not None and sender._spare is None and sender.holding()
        want = {"prompt_0": torch.randn(300, 512), "prompt_1": torch.randn(212, 512)}
        for n, v in views.items():
            v.copy_(want[n])
        # a payload that is not the reservation's (another event) takes the normal path
        other = {"y": torch.randn(512, 512)}
        _, got = _send_then_recv(a, b, sender, receiver, other)
        assert_same_tensors(got, other)
        assert sender._reserved is not None and sender.handed == 0
        copies = []
        real_copy = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_",
                            lambda self, src, *a, **k: copies.append(1) or real_copy(self, src, *a, **k))
        _, got = _send_then_recv(a, b, sender, receiver, views)
        monkeypatch.undo()
        assert copies == [] and sender.handed == 1 and receiver.owned == 1 and sender._reserved is None
        assert_same_tensors(got, want)
        del views
        sender.close()
        receiver.drop()


def test_a_reservation_needs_the_feature_a_large_payload_and_a_fitting_spare():
    a, b, sender, receiver = _own_pair()
    with a, b:
        assert sender.reserve(1 << 20) is None  # no spare yet
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})
        _spare_made(sender)
        assert sender.reserve(1 << 10) is None  # under own_min_bytes
        assert sender.reserve(8 << 20) is None  # the 1 MiB spare cannot hold it
        plain = ArenaSender(arena.Budget(), min_bytes=1 << 16)  # no hand-over feature
        assert plain.reserve(1 << 20) is None
        sender.close()
        receiver.drop()


def _memfds() -> list[int]:
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            if "ltx_mgpu-arena" in os.readlink(f"/proc/self/fd/{f}"):
                out.append(int(f))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("how", ["drop", "close", "newer reservation"])
def test_a_reservation_dropped_under_a_job_stays_writable_and_its_payload_is_copied(how):
    """The idle drop, the connection closing or a newer reservation may take a reservation away
    while a job still writes its rows there: the rows stay valid memory (unmapped only with the
    last view), the payload then goes the ordinary way, and the budget gets everything back."""
    before = set(_memfds())
    a, b, sender, receiver = _own_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})
        _spare_made(sender)
        views = _reserved_views(sender, [("r", torch.float32, (512, 512))])
        views["r"].fill_(1.0)
        if how == "drop":
            sender.drop()
        elif how == "close":
            sender.close()
        else:
            _send_then_recv(a, b, sender, receiver, {"y": torch.randn(512, 512)})  # spare taken, a new one made
            _spare_made(sender)
            assert _reserved_views(sender, [("s", torch.float32, (512, 512))]) is not None
        views["r"].fill_(2.0)  # the job's next row: must not touch unmapped memory
        if how != "close":
            _, got = _send_then_recv(a, b, sender, receiver, views)
            assert torch.equal(got["r"], torch.full((512, 512), 2.0))
        handed = sender.handed
        sender.close()
        receiver.drop()
        _spare_made(sender)  # a spare still being made gives its budget back when it lands
        assert sender.budget.used == 0 and sender.handed == handed
    del views
    assert set(_memfds()) <= before


def test_a_reservation_racing_close_is_not_kept_and_reservations_count_in_the_budget(monkeypatch):
    before = set(_memfds())
    a, b, sender, receiver = _own_pair()
    with a, b:
        _send_then_recv(a, b, sender, receiver, {"x": torch.randn(512, 512)})
        _spare_made(sender)
        arena_bytes = sender.arena.size
        assert sender.budget.used == arena_bytes + sender._spare.size
        views = _reserved_views(sender, [("r", torch.float32, (512, 512))])
        assert sender.budget.used == arena_bytes + sender._reserved.size  # a reservation is still the pool's
        views["r"].fill_(3.0)
        _, got = _send_then_recv(a, b, sender, receiver, views)
        assert sender.handed == 1 and torch.equal(got["r"], torch.full((512, 512), 3.0))
        del views, got
        _spare_made(sender)
        take = sender._take_spare

        def take_then_close(need, release=True):  # the writer closes the connection right here
            spare = take(need, release)
            sender.close()
            return spare

        monkeypatch.setattr(sender, "_take_spare", take_then_close)
        assert sender.reserve(1 << 20) is None and sender._reserved is None
        receiver.drop()
        _spare_made(sender)
        assert sender.budget.used == 0
    assert set(_memfds()) <= before  # (earlier tests' mappings may live on until collected)
