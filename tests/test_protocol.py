"""The wire protocol on its own (socket pairs, no pool): framing, tensors, limits, schemas, and
the shared-memory arena frames (real memfds and descriptors passed over real sockets)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import struct
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ltx_mgpu import protocol, shm
from ltx_mgpu.protocol import Limits, ProtocolError, SchemaError


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a, b


def _send_async(sock, data: bytes, close: bool = True):
    def run():
        try:
            sock.sendall(data)
            if close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the reader may have given up and closed first
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _roundtrip(header, tensors=None, limits=None):
    a, b = _pair()
    with a, b:
        payload = protocol.tensors_to_payload(tensors)
        t = threading.Thread(target=protocol.send_frame, args=(a, header, payload, limits), daemon=True)
        t.start()
        out = protocol.recv_frame(b, limits)
        t.join()
    return out


def _assert_same(got: dict, want: dict):
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v.detach().cpu()), k


def test_frame_roundtrip_with_tensors_of_every_kind():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with torch.inference_mode():
        inference = torch.ones(3) * 2  # ComfyUI hands over inference tensors
    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(-5, 5), "u8": torch.arange(256, dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "transposed": base.t(), "alias_a": base,
        "alias_b": base[1:3], "inference": inference, "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    header = {"type": "selftest", "id": "x1", "params": {"steps": 1, "note": "ünïcode ✓"}}
    got_header, got = _roundtrip(header, tensors)
    assert got_header == header
    _assert_same({k: v.float() if v.dtype == torch.float8_e4m3fn else v for k, v in got.items()},
                 {k: v.float() if v.dtype == torch.float8_e4m3fn else v for k, v in tensors.items()})


def test_payload_is_standard_safetensors():
    tensors = {"b": torch.randn(5, 3), "a": torch.arange(7, dtype=torch.int32), "c": torch.randn(2).bfloat16()}
    ours = protocol.tensors_to_payload(tensors).tobytes()
    _assert_same(st_load(ours), tensors)  # the library parses what we write...
    _assert_same(protocol.payload_to_tensors(st_save(tensors)), tensors)  # ...and we parse what it writes
    hlen = struct.unpack("<Q", ours[:8])[0]
    assert (8 + hlen) % 8 == 0 and json.loads(ours[8:8 + hlen])["a"]["dtype"] == "I32"


def test_no_tensors_means_no_payload():
    assert protocol.tensors_to_payload(None) is None and protocol.tensors_to_payload({}) is None
    header, tensors = _roundtrip({"event": "result", "id": "r", "result": {}})
    assert tensors == {}


def test_tensor_helper_errors_name_the_problem():
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        protocol.tensors_to_payload({"x": [1, 2]})
    with pytest.raises(TypeError, match="names must be non-empty strings"):
        protocol.tensors_to_payload({1: torch.zeros(1)})


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=20), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)
_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float16])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.dictionaries(st.text(min_size=1, max_size=10), _json, max_size=5),
       shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=4), dtype=_dtypes)
def test_roundtrip_property(header, shapes, dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randint(0, 100, s, generator=gen)).to(dtype) for i, s in enumerate(shapes)}
    got_header, got = _roundtrip(header, tensors)
    assert got_header == header
    _assert_same(got, tensors)


def _prefix(header_len, payload_len, magic=protocol.MAGIC, version=protocol.PROTOCOL_VERSION, flags=0):
    return struct.pack("!4sHHIQ", magic, version, flags, header_len, payload_len)


def _recv_error(data: bytes, limits=None) -> str:
    a, b = _pair()
    with a, b:
        _send_async(a, data)
        b.settimeout(10)
        with pytest.raises(ProtocolError) as e:
            protocol.recv_frame(b, limits)
    return str(e.value)


@pytest.mark.parametrize("data, match", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    (_prefix(2, 0, version=99) + b"{}", "protocol version 99"),
    (_prefix(2, 0, flags=1) + b"{}", "flags"),
    (_prefix(protocol.MAX_HEADER_BYTES + 1, 0), "over the 1048576-byte limit"),
    (_prefix(10, 0) + b"{}", "truncated"),
    (_prefix(2, 100) + b"{}" + b"x" * 10, "truncated"),
    (_prefix(3, 0) + b"[1]", "JSON object"),
    (_prefix(3, 0) + b"\xff\xfe{", "not UTF-8 JSON"),
    (_prefix(3, 0) + b"NaN", "not UTF-8 JSON"),
    (_prefix(2, 12) + b"{}" + b"not-a-tensor", "safetensors"),
    (b"LTX", "truncated"),
])
def test_malformed_frames_raise_protocol_error(data, match):
    assert match in _recv_error(data)


def test_payload_limit_is_enforced_before_reading():
    msg = _recv_error(_prefix(2, 1 << 20) + b"{}", Limits(max_payload_bytes=1000))
    assert "over the 1000-byte limit" in msg
    a, b = _pair()
    with a, b, pytest.raises(ProtocolError, match="payload is"):
        protocol.send_frame(a, {"x": 1}, protocol.tensors_to_payload({"t": torch.zeros(1000)}),
                            Limits(max_payload_bytes=100))


def test_clean_eof_is_connection_closed():
    a, b = _pair()
    a.close()
    with b, pytest.raises(protocol.ConnectionClosed):
        protocol.recv_frame(b)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_escapes_as_other_errors(data):
    a, b = _pair()
    with a, b:
        _send_async(a, data)
        b.settimeout(10)
        try:
            protocol.recv_frame(b)
        except ProtocolError:
            pass


# --------------------------------------------------------------------------- schemas

def test_requests_validate_envelope_and_params():
    req = protocol.parse_request({"type": "selftest", "id": "a-1", "params": {"steps": 2, "step_seconds": 0.5}})
    assert req.type == "selftest" and req.params["steps"] == 2 and req.schema.job
    with pytest.raises(ProtocolError, match="unknown request type 'bogus'"):
        protocol.parse_request({"type": "bogus", "id": "x"})
    with pytest.raises(ProtocolError, match="request id"):
        protocol.parse_request({"type": "status", "id": "has space"})
    with pytest.raises(ProtocolError, match="unknown top-level keys"):
        protocol.parse_request({"type": "status", "id": "x", "extra": 1})
    with pytest.raises(ProtocolError, match="takes no tensors"):
        protocol.parse_request({"type": "status", "id": "x"}, {"t": torch.zeros(1)})


@pytest.mark.parametrize("mtype, params, match", [
    ("selftest", {}, "missing the required field 'steps'"),
    ("selftest", {"steps": True}, "selftest.steps must be int"),
    ("selftest", {"steps": 1.5}, "selftest.steps must be int"),
    ("selftest", {"steps": 1, "colour": "red"}, "unknown field"),
    ("hello", {"token": 5}, "hello.token must be str"),
    ("load_text_encoder", {"source": "x", "placement": "everywhere"}, "must be one of"),
    ("encode", {"prompts": ["a", 3]}, r"encode.prompts\[1\] must be str"),
    ("cancel", {}, "missing the required field 'job_id'"),
])
def test_schema_errors_are_schema_errors(mtype, params, match):
    with pytest.raises(SchemaError, match=match) as e:
        protocol.parse_request({"type": mtype, "id": "rid", "params": params})
    assert e.value.request_id == "rid"


def test_text_job_params_are_declared_and_unknown_ones_refused_at_receipt():
    load = {"source": "/g", "projection": "/p", "weights": "nf4", "placement": "single", "dtype": "bfloat16",
            "max_memory": {"0": "70GiB"}, "token_budget": 1024, "truncate": False, "key": "text:abc"}
    assert protocol.parse_request({"type": "load_text_encoder", "id": "l", "params": load}).params == load
    protocol.parse_request({"type": "load_text_encoder", "id": "l", "params": {"source": "/g", "key": None,
                                                                                "max_memory": None}})
    encode = {"prompts": ["a"], "batch_size": 2, "expect": "text:abc", "keep": False, "verify": True}
    assert protocol.parse_request({"type": "encode", "id": "e", "params": encode}).params == encode
    for mtype, params, match in [
        ("encode", {"prompts": ["a"], "max_tokens": 1024}, r"unknown field\(s\) \['max_tokens'\]"),
        ("load_text_encoder", {"source": "/g", "colour": "red"}, r"unknown field\(s\) \['colour'\]"),
        ("load_text_encoder", {"source": "/g", "truncate": "no"}, "truncate must be bool"),
        ("load_text_encoder", {"source": "/g", "token_budget": 1.5}, "token_budget must be int"),
        ("load_text_encoder", {"source": "/g", "max_memory": [1]}, "max_memory must be object or null"),
        ("encode", {"prompts": [], "keep": 1}, "keep must be bool"),
        ("encode", {"prompts": [], "expect": 3}, "expect must be str or null"),
    ]:
        with pytest.raises(SchemaError, match=match):
            protocol.parse_request({"type": mtype, "id": "x", "params": params})


def test_events_validate():
    ev = protocol.make_event("progress", "j1", phase="denoise", step=3, total=30)
    assert protocol.parse_event(ev) == ev
    with pytest.raises(ProtocolError, match="must be one of"):
        protocol.make_event("error", "j1", kind="oops", message="m")
    with pytest.raises(ProtocolError, match="unknown event"):
        protocol.parse_event({"event": "nope", "id": "x"})
    with pytest.raises(ProtocolError, match="missing"):
        protocol.parse_event({"event": "progress", "id": "x", "phase": "a", "step": 1})


def test_register_request_adds_a_job_type():
    schema = protocol.register_request(protocol.MessageSchema(
        "sample_test_only", (protocol.F("steps", ("int",)),), tensors=True))
    try:
        assert "sample_test_only" in protocol.job_types()
        protocol.parse_request({"type": "sample_test_only", "id": "s", "params": {"steps": 3}},
                               {"latent": torch.zeros(2)})
    finally:
        protocol.REQUESTS.pop(schema.name)


# --------------------------------------------------------------------------- shared-memory frames

def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _arena_pair(min_bytes=1 << 16, take=None):
    a, b = _pair()
    return a, b, shm.ArenaSender(shm.Budget(), min_bytes=min_bytes), shm.ArenaReceiver(take)


def _send_then_recv(a, b, sender, receiver, tensors, header=None):
    t = threading.Thread(target=protocol.send_frame, args=(a, header or {"event": "x"},
                                                           protocol.tensors_to_payload(tensors)),
                         kwargs={"shm": sender}, daemon=True)
    t.start()
    out = protocol.recv_frame(b, shm=receiver)
    t.join()
    return out


def test_arena_frames_round_trip_reuse_the_arena_and_replace_it_when_too_small():
    a, b, sender, receiver = _arena_pair()
    with a, b:
        small = {"t": torch.arange(10)}
        _, got = _send_then_recv(a, b, sender, receiver, small)
        _assert_same(got, small)
        assert receiver.frames == 0  # under min_bytes: the socket
        big = {"x": torch.randn(300, 257), "y": torch.randn(100, 33).bfloat16(), "e": torch.zeros(0, 4)}
        for k in range(3):
            header, got = _send_then_recv(a, b, sender, receiver, big, {"event": "x", "k": k})
            assert header == {"event": "x", "k": k}  # the shm reference is consumed by the frame layer
            _assert_same(got, big)
            assert not any(receiver.arena.holds(t) for t in got.values())  # copies of their own
        assert (receiver.frames, receiver.arenas, sender.seq) == (3, 1, 3)  # one warm arena, reused
        bigger = {"z": torch.randn(1000, 1000)}
        _, got = _send_then_recv(a, b, sender, receiver, bigger)
        _assert_same(got, bigger)
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
        _assert_same(plain, want)
        sender.close()
        receiver.drop()


def test_an_unacknowledged_arena_is_not_overwritten_the_socket_carries_the_next_payload():
    a, b, sender, receiver = _arena_pair()
    with a, b:
        first, second = {"t": torch.full((200, 200), 1.0)}, {"t": torch.full((200, 200), 2.0)}
        protocol.send_frame(a, {"event": "x"}, protocol.tensors_to_payload(first), shm=sender)
        protocol.send_frame(a, {"event": "x"}, protocol.tensors_to_payload(second), shm=sender)
        assert sender.frames == 1  # the receiver has not read the first one yet
        _assert_same(protocol.recv_frame(b, shm=receiver)[1], first)
        _assert_same(protocol.recv_frame(b, shm=receiver)[1], second)
        assert sender.idle(now=time.monotonic() + sender.idle_seconds)  # acknowledged and idle
        protocol.send_frame(a, {}, flags=protocol.FLAG_SHM_DROP)
        protocol.send_frame(a, {"event": "x"}, None)
        assert protocol.recv_frame(b, shm=receiver) == ({"event": "x"}, {})  # the notice is consumed
        assert receiver.arena is None
        sender.close()


def _memfd(size=1 << 20, seal=True) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _ref(arena=1, seq=99, offset=64, size=100):
    return {"arena": arena, "seq": seq, "offset": offset, "size": size}


@pytest.mark.parametrize("flags, header, fd, match", [
    (protocol.FLAG_SHM, {"event": "x"}, None, "shm reference must be"),
    (protocol.FLAG_SHM, {"event": "x", "shm": {**_ref(), "name": "../../etc/passwd"}}, None, "shm reference must be"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(seq=True)}, None, "shm reference must be"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(offset=-64)}, None, "shm reference must be"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(arena=7)}, None, "refers to arena 7, but this connection maps 1"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(offset=1 << 30)}, None, "not a payload range"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(offset=0)}, None, "not a payload range"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(seq=1)}, None, "sequence number 1 is not after"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref(size=1000)}, None, "not a valid safetensors blob"),
    (protocol.FLAG_SHM | protocol.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, None, "0 file descriptor"),
    (protocol.FLAG_SHM, {"event": "x", "shm": _ref()}, "memfd", "1 file descriptor(s) came with a frame of flags 0x1"),
    (protocol.FLAG_SHM | protocol.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "file", "not a memfd"),
    (protocol.FLAG_SHM | protocol.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "pipe", "not a regular"),
    (protocol.FLAG_SHM | protocol.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "unsealed", "not sealed"),
    (protocol.FLAG_SHM | protocol.FLAG_SHM_FD, {"event": "x", "shm": _ref(arena=2)}, "five", "too many file"),
    (protocol.FLAG_SHM_DROP, {"event": "x"}, None, "drop notice must have an empty header"),
    (protocol.FLAG_SHM_DROP | protocol.FLAG_SHM, {}, None, "not a valid combination"),
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
        raw = json.dumps(header).encode()
        shm.send_with_fds(a, struct.pack("!4sHHIQ", protocol.MAGIC, protocol.PROTOCOL_VERSION, flags, len(raw), 0)
                          + raw, fds)
        for f in fds:
            os.close(f)
        b.settimeout(10)
        with pytest.raises(ProtocolError, match=re.escape(match)):
            protocol.recv_frame(b, shm=receiver)
        assert _fd_count() <= before  # what came with the frame was closed
        sender.close()
        receiver.drop()


def test_shm_frames_on_a_connection_without_the_feature_are_refused():
    msg = _recv_error(_prefix(2, 0, flags=protocol.FLAG_SHM) + b"{}")
    assert "only to clients that enabled 'shm'" in msg
