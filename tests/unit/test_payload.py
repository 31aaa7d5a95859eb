"""The in-place safetensors codec (ltx_mgpu.wire.payload): strict header checks, parity with the
safetensors library in both directions, zero-copy views and their lifetime."""

from __future__ import annotations

import gc
import json
import socket
import struct
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ltx_mgpu import wire
from ltx_mgpu.wire.payload import DTYPES, PayloadError, parse_payload, payload_layout, tensors_to_payload


def _blob(header: dict, data: bytes = b"", raw: bytes | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_parity_with_the_library_both_ways_and_metadata():
    tensors = {"w": torch.randn(3, 4), "ids": torch.arange(5), "h": torch.randn(2).bfloat16(),
               "mask": torch.tensor([True, False]), "none": torch.zeros(0, 3), "s": torch.tensor(1.5)}
    ours = tensors_to_payload(tensors).tobytes()
    _same(st_load(ours), tensors)
    _same(parse_payload(ours), tensors)
    theirs = st_save(tensors, metadata={"format": "pt", "note": "x"})  # the library's layout and metadata
    _same(parse_payload(theirs), tensors)
    _same(parse_payload(bytearray(theirs)), tensors)


def test_every_allowed_dtype_round_trips_through_the_library():
    gen = torch.Generator().manual_seed(0)
    tensors = {code: torch.randint(0, 2, (3,), generator=gen).to(dt) for code, dt in DTYPES.items()}
    _same(parse_payload(st_save(tensors)), tensors)
    _same(st_load(tensors_to_payload(tensors).tobytes()), tensors)


def test_writable_buffers_are_viewed_not_copied_and_outlive_their_name():
    want = {"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(3, dtype=torch.int64)}
    buf = bytearray(tensors_to_payload(want).tobytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable buffers; ours must be writable
        got = parse_payload(buf)
    hlen = struct.unpack("<Q", buf[:8])[0]
    struct.pack_into("<f", buf, 8 + hlen + 4, 42.0)  # a["a"][1] lives in buf: a view, not a copy
    assert got["a"][1].item() == 42.0
    got["b"][0] = 7  # writable, writes through
    assert struct.unpack_from("<q", buf, 8 + hlen + 24)[0] == 7
    del buf
    gc.collect()
    assert got["a"].tolist() == [0, 42, 2, 3, 4, 5] and got["b"].tolist() == [7, 1, 2]


def test_read_only_bytes_are_copied_once_into_writable_tensors():
    blob = tensors_to_payload({"x": torch.ones(4)}).tobytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = parse_payload(blob)["x"]
    x += 1
    assert x.tolist() == [2.0] * 4 and parse_payload(blob)["x"].tolist() == [1.0] * 4


@pytest.mark.parametrize("offset, shared", [(0, True), (8, True), (3, False)])
def test_a_uint8_tensor_is_parsed_in_place_when_aligned(offset, shared):
    want = {"a": torch.randn(5), "b": torch.arange(7), "c": torch.randn(3).bfloat16()}
    blob = tensors_to_payload(want).tobytes()
    buf = torch.zeros(offset + len(blob), dtype=torch.uint8)
    buf[offset:] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    got = parse_payload(buf[offset:])  # e.g. a control-group broadcast buffer, past its JSON part
    _same(got, want)
    assert (got["a"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()) == shared


def test_received_frame_tensors_share_one_buffer_and_are_writable():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    want = {"big": torch.randn(1000), "small": torch.arange(10)}
    with a, b:
        sender = threading.Thread(target=wire.send_frame, args=(a, {"x": 1}, wire.tensors_to_payload(want)))
        sender.start()
        _, got = wire.recv_frame(b)
        sender.join()
    _same(got, want)
    assert got["big"].untyped_storage().data_ptr() == got["small"].untyped_storage().data_ptr()
    got["big"].mul_(2)  # no copy-on-write, no warning: an ordinary writable CPU tensor
    assert torch.equal(got["big"], want["big"] * 2) and torch.equal(got["small"], want["small"])


def test_misaligned_tensor_from_another_writer_is_copied_aligned():
    data = bytes([1, 2, 3]) + struct.pack("<2f", 0.5, -2.0)  # f32 at data byte 3: legal, misaligned
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    blob = _blob(header, data, raw=json.dumps(header).encode() + b"   ")
    got = parse_payload(bytearray(blob))
    _same(got, st_load(blob))
    assert got["b"].data_ptr() % 4 == 0 and got["b"].tolist() == [0.5, -2.0]


_F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("blob, match", [
    (b"\x01\x00", "cannot hold"),
    (struct.pack("<Q", 100) + b"{}", "exceeds"),
    (_blob({}, raw=b' {"a": 1}'), "starting with '{'"),
    (_blob({}, raw=b"{\xff}"), "not UTF-8 JSON"),
    (_blob({}, raw=b'{"a": NaN}'), "not UTF-8 JSON"),
    (_blob({}, raw=b'{"t": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, '
                   b'"t": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}'), "twice"),
    (_blob({"__metadata__": {"k": 1}}), "__metadata__"),
    (_blob({"t": {**_F32, "dtype": "F4"}}, bytes(8)), "allowed"),
    (_blob({"t": {**_F32, "dtype": "object"}}, bytes(8)), "allowed"),
    (_blob({"t": {**_F32, "shape": [-2]}}, bytes(8)), "shape"),
    (_blob({"t": {**_F32, "shape": [True, 2]}}, bytes(8)), "shape"),
    (_blob({"t": {**_F32, "shape": [1] * 65}}, bytes(4)), "shape"),
    (_blob({"t": {**_F32, "data_offsets": [0]}}, bytes(8)), "data_offsets"),
    (_blob({"t": {**_F32, "data_offsets": [8, 0]}}, bytes(8)), "data_offsets"),
    (_blob({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly the fields"),
    (_blob({"t": {**_F32, "pickle": "x"}}, bytes(8)), "exactly the fields"),
    (_blob({"t": {**_F32, "data_offsets": [0, 12]}}, bytes(12)), "needs 8"),
    (_blob({"t": {**_F32, "data_offsets": [4, 12]}}, bytes(12)), "a gap"),
    (_blob({"t": _F32, "u": {**_F32, "data_offsets": [4, 12]}}, bytes(12)), "an overlap"),
    (_blob({"t": _F32}, bytes(4)), "exceeds|cover"),
    (_blob({"t": _F32}, bytes(12)), "cover 8 data bytes, but the blob holds 12"),
    (_blob({"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"), "BOOL"),
])
def test_invalid_blobs_are_rejected_naming_the_rule(blob, match):
    with pytest.raises(PayloadError, match=match):
        parse_payload(bytearray(blob))
    with pytest.raises(wire.ProtocolError, match="not a valid safetensors blob"):
        wire.payload_to_tensors(blob)


_codes = st.sampled_from(["F32", "U8", "BF16", "I64", "BOOL", "F8_E4M3", "F4", "Q"])
_sizes = {"F32": 4, "U8": 1, "BF16": 2, "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F4": 1, "Q": 1}


@st.composite
def _headers(draw):
    entries, off = {}, 0
    for k in range(draw(st.integers(0, 3))):
        code = draw(_codes)
        shape = draw(st.lists(st.integers(0, 3), max_size=2))
        numel = 1
        for d in shape:
            numel *= d
        start = off + draw(st.sampled_from([0, 0, 0, 1, -1]))
        end = start + numel * _sizes[code] + draw(st.sampled_from([0, 0, 0, 1, -1]))
        entries[f"t{k}"] = {"dtype": code, "shape": shape, "data_offsets": [start, end]}
        off = end
    n = max(0, off + draw(st.sampled_from([0, 0, 1, -1])))
    data = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    return _blob(entries, data)


@settings(max_examples=150, deadline=None)
@given(_headers())
def test_we_accept_exactly_what_the_library_accepts_with_the_same_tensors(blob):
    """Differential check: near-valid headers (offsets, sizes, dtypes off by a little); bytes
    are 0/1 so the BOOL rule (ours only) never decides."""
    try:
        ours, ours_err = parse_payload(bytearray(blob)), None
    except PayloadError as e:
        ours, ours_err = None, e
    try:
        lib, lib_err = st_load(blob), None
    except Exception as e:  # noqa: BLE001 - the library raises several types
        lib, lib_err = None, e
    assert (ours_err is None) == (lib_err is None), (ours_err, lib_err)
    if ours is not None:
        _same(ours, lib)


def test_the_layout_known_in_advance_is_the_payloads():
    """payload_layout (names, dtypes, shapes only) gives the header bytes tensors_to_payload writes
    and the byte range of each tensor in the blob (name order: prompt_10 before prompt_2)."""
    tensors = {f"prompt_{i}": torch.randn(i + 1, 3) for i in range(12)}
    tensors["mask"] = torch.ones(5, dtype=torch.bool)
    tensors["half"] = torch.randn(3, 7).to(torch.bfloat16)
    head, spans = payload_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    blob = tensors_to_payload(tensors).tobytes()
    assert blob[:len(head)] == head
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert spans[name][1] - spans[name][0] == len(raw)
        assert blob[spans[name][0]:spans[name][0] + len(raw)] == raw
    assert sorted(spans, key=spans.get) == sorted(tensors)
    assert max(end for _, end in spans.values()) == len(blob)
    with pytest.raises(TypeError, match="safetensors cannot carry"):
        payload_layout([("x", torch.complex32, (2,))])
