"""The wire protocol on its own (socket pairs, no pool): framing, tensors, limits, schemas, and
the shared-memory arena frames (real memfds and descriptors passed over real sockets)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import assert_same_tensors, socket_pair
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ltx_mgpu import wire
from ltx_mgpu.wire.frames import Limits, ProtocolError
from ltx_mgpu.wire.messages import MAX_TEXT_TOKENS, SchemaError


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
    a, b = socket_pair()
    with a, b:
        payload = wire.tensors_to_payload(tensors)
        t = threading.Thread(target=wire.send_frame, args=(a, header, payload, limits), daemon=True)
        t.start()
        out = wire.recv_frame(b, limits)
        t.join()
    return out


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
    assert_same_tensors({k: v.float() if v.dtype == torch.float8_e4m3fn else v for k, v in got.items()},
                 {k: v.float() if v.dtype == torch.float8_e4m3fn else v for k, v in tensors.items()})


def test_payload_is_standard_safetensors():
    tensors = {"b": torch.randn(5, 3), "a": torch.arange(7, dtype=torch.int32), "c": torch.randn(2).bfloat16()}
    ours = wire.tensors_to_payload(tensors).tobytes()
    assert_same_tensors(st_load(ours), tensors)  # the library parses what we write...
    assert_same_tensors(wire.payload_to_tensors(st_save(tensors)), tensors)  # ...and we parse what it writes
    hlen = struct.unpack("<Q", ours[:8])[0]
    assert (8 + hlen) % 8 == 0 and json.loads(ours[8:8 + hlen])["a"]["dtype"] == "I32"


def test_no_tensors_means_no_payload():
    assert wire.tensors_to_payload(None) is None and wire.tensors_to_payload({}) is None
    header, tensors = _roundtrip({"event": "result", "id": "r", "result": {}})
    assert tensors == {}


def test_tensor_helper_errors_name_the_problem():
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        wire.tensors_to_payload({"x": [1, 2]})
    with pytest.raises(TypeError, match="names must be non-empty strings"):
        wire.tensors_to_payload({1: torch.zeros(1)})


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
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
    assert_same_tensors(got, tensors)


def _prefix(header_len, payload_len, magic=wire.MAGIC, version=wire.PROTOCOL_VERSION, flags=0):
    return struct.pack("!4sHHIQ", magic, version, flags, header_len, payload_len)


def _recv_error(data: bytes, limits=None) -> str:
    a, b = socket_pair()
    with a, b:
        _send_async(a, data)
        b.settimeout(10)
        with pytest.raises(ProtocolError) as e:
            wire.recv_frame(b, limits)
    return str(e.value)


@pytest.mark.parametrize("data, match", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    (_prefix(2, 0, version=99) + b"{}", "protocol version 99"),
    (_prefix(2, 0, flags=1) + b"{}", "flags"),
    (_prefix(wire.MAX_HEADER_BYTES + 1, 0), "over the 1048576-byte limit"),
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
    a, b = socket_pair()
    with a, b, pytest.raises(ProtocolError, match="payload is"):
        wire.send_frame(a, {"x": 1}, wire.tensors_to_payload({"t": torch.zeros(1000)}),
                            Limits(max_payload_bytes=100))


def test_clean_eof_is_connection_closed():
    a, b = socket_pair()
    a.close()
    with b, pytest.raises(wire.ConnectionClosed):
        wire.recv_frame(b)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_escapes_as_other_errors(data):
    a, b = socket_pair()
    with a, b:
        _send_async(a, data)
        b.settimeout(10)
        with contextlib.suppress(ProtocolError):
            wire.recv_frame(b)


# --------------------------------------------------------------------------- schemas

def test_requests_validate_envelope_and_params():
    req = wire.parse_request({"type": "selftest", "id": "a-1", "params": {"steps": 2, "step_seconds": 0.5}})
    assert req.type == "selftest" and req.params["steps"] == 2 and req.schema.job
    with pytest.raises(ProtocolError, match="unknown request type 'bogus'"):
        wire.parse_request({"type": "bogus", "id": "x"})
    with pytest.raises(ProtocolError, match="request id"):
        wire.parse_request({"type": "status", "id": "has space"})
    with pytest.raises(ProtocolError, match="unknown top-level keys"):
        wire.parse_request({"type": "status", "id": "x", "extra": 1})
    with pytest.raises(ProtocolError, match="takes no tensors"):
        wire.parse_request({"type": "status", "id": "x"}, {"t": torch.zeros(1)})


@pytest.mark.parametrize("mtype, params, match", [
    ("selftest", {}, "missing the required field 'steps'"),
    ("selftest", {"steps": True}, "selftest.steps must be int"),
    ("selftest", {"steps": 1.5}, "selftest.steps must be int"),
    ("selftest", {"steps": 1, "colour": "red"}, "unknown field"),
    ("hello", {"token": 5}, "hello.token must be str"),
    ("load_text_encoder", {"source": "x", "placement": 3}, "load_text_encoder.placement must be str"),
    ("encode", {"prompts": ["a", 3]}, r"encode.prompts\[1\] must be str"),
    ("cancel", {}, "missing the required field 'job_id'"),
])
def test_schema_errors_are_schema_errors(mtype, params, match):
    with pytest.raises(SchemaError, match=match) as e:
        wire.parse_request({"type": mtype, "id": "rid", "params": params})
    assert e.value.request_id == "rid"


def test_text_job_params_are_declared_and_unknown_ones_refused_at_receipt():
    load = {"source": "/g", "projection": "/p", "weights": "nf4", "placement": "single", "dtype": "bfloat16",
            "max_memory": {"0": "70GiB"}, "token_budget": 1024, "truncate": False, "key": "text:abc"}
    assert wire.parse_request({"type": "load_text_encoder", "id": "l", "params": load}).params == load
    wire.parse_request({"type": "load_text_encoder", "id": "l", "params": {"source": "/g", "key": None,
                                                                                "max_memory": None}})
    encode = {"prompts": ["a"], "batch_size": 2, "expect": "text:abc", "keep": False, "verify": True,
              "max_tokens": MAX_TEXT_TOKENS}
    assert wire.parse_request({"type": "encode", "id": "e", "params": encode}).params == encode
    for mtype, params, match in [
        ("encode", {"prompts": ["a"], "tokens": 1024}, r"unknown field\(s\) \['tokens'\]"),
        ("encode", {"prompts": ["a"], "max_tokens": MAX_TEXT_TOKENS + 1}, r"max_tokens must be in 1\.\.8192"),
        ("load_text_encoder", {"source": "/g", "colour": "red"}, r"unknown field\(s\) \['colour'\]"),
        ("load_text_encoder", {"source": "/g", "truncate": "no"}, "truncate must be bool"),
        ("load_text_encoder", {"source": "/g", "token_budget": 1.5}, "token_budget must be int"),
        ("load_text_encoder", {"source": "/g", "max_memory": [1]}, "max_memory must be object or null"),
        ("encode", {"prompts": [], "keep": 1}, "keep must be bool"),
        ("encode", {"prompts": [], "expect": 3}, "expect must be str or null"),
    ]:
        with pytest.raises(SchemaError, match=match):
            wire.parse_request({"type": mtype, "id": "x", "params": params})


def test_events_validate():
    ev = wire.make_event("progress", "j1", phase="denoise", step=3, total=30)
    assert wire.parse_event(ev) == ev
    with pytest.raises(ProtocolError, match="must be one of"):
        wire.make_event("error", "j1", kind="oops", message="m")
    with pytest.raises(ProtocolError, match="unknown event"):
        wire.parse_event({"event": "nope", "id": "x"})
    with pytest.raises(ProtocolError, match="missing"):
        wire.parse_event({"event": "progress", "id": "x", "phase": "a", "step": 1})


def test_register_request_adds_a_job_type():
    schema = wire.register_request(wire.MessageSchema(
        "sample_test_only", (wire.F("steps", ("int",)),), tensors=True))
    try:
        assert "sample_test_only" in wire.job_types()
        wire.parse_request({"type": "sample_test_only", "id": "s", "params": {"steps": 3}},
                               {"latent": torch.zeros(2)})
    finally:
        wire.REQUESTS.pop(schema.name)


# --------------------------------------------------------------------------- shared-memory frames
# (the arena itself: tests/unit/test_shm.py)

def test_shm_frames_on_a_connection_without_the_feature_are_refused():
    msg = _recv_error(_prefix(2, 0, flags=wire.FLAG_SHM) + b"{}")
    assert "only to clients that enabled 'shm'" in msg


def test_a_request_is_checked_once_on_the_client_with_its_tensors_and_its_size():
    # make_request is the client's one check: the params' schema, the tensors, the encoded size
    with pytest.raises(ProtocolError, match="takes no tensors"):
        wire.make_request("status", "s", {}, {"t": torch.zeros(1)})
    with pytest.raises(ProtocolError, match=r"header is \d+ bytes, over the 1048576-byte limit"):
        wire.make_request("encode", "e", {"prompts": ["x" * 600_000, "y" * 600_000]})
    header = wire.make_request("encode", "e", {"prompts": ["a cat"]})
    assert header == {"type": "encode", "id": "e", "params": {"prompts": ["a cat"]}}


def test_a_prompt_that_is_not_unicode_is_refused_before_the_pool_asks_for_a_text_encoder():
    # the pool's first answer to an encode without a resident encoder makes the client load Gemma;
    # a prompt the tokenizer cannot take is refused before that, so it never costs a Gemma load
    from ltx_mgpu.pool.engines import BadInput, JobContext, ModelStore
    from ltx_mgpu.pool.text_jobs import encode

    ctx = JobContext(0, 1, 0, torch.device("cpu"), None, None, ModelStore(), "j", "encode")
    with pytest.raises(BadInput, match=r"prompts\[0\] is not valid Unicode text"):
        encode(ctx, {"prompts": ["caf\udcff"]}, {})
    with pytest.raises(BadInput, match="no text encoder is loaded"):
        encode(ctx, {"prompts": ["café"]}, {})
