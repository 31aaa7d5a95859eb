"""GGUF files and the GGML block formats (``ltx_mgpu.quantized.ggml``): every type read here
dequantizes to ``gguf.quants.dequantize``'s values bit for bit (random blocks: every bit pattern
of the codes and scales, finite scales), a tensor's bytes come back from a written file as
written, and what is not read is refused naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ltx_mgpu.quantized.ggml import BLOCK_SHAPES, READABLE, GGMLFormatError, GGUFFile, dequantize, packed_shape

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (requirements-dev.txt)")


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of ``cols`` values of ``qtype`` as random bytes whose fp16 scales are
    finite (any code and sub-scale bit pattern), ``[rows, row bytes]`` uint8."""
    block, size = BLOCK_SHAPES[qtype]
    rng = np.random.default_rng(seed)
    if qtype == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qtype in ("F16", "BF16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == "F16":
            return values.astype(np.float16).view(np.uint8)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16).view(np.uint8)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(-2.0, 2.0, (rows * cols // block, 2)).astype(np.float16).view(np.uint8)
    at = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}.get(
        qtype, [0, 2] if qtype in ("Q4_1", "Q5_1") else [0])
    for j, offset in enumerate(at):  # the fp16 fields (d, dmin / m) of each block
        raw[:, offset:offset + 2] = scales[:, 2 * j:2 * j + 2]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", READABLE)
def test_every_type_dequantizes_as_gguf_does_bit_for_bit(qtype):
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]] == BLOCK_SHAPES[qtype]
    rows, cols = 5, 768
    raw = random_blocks(qtype, rows, cols)
    want = torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, cols), dtype=np.float32))
    got = dequantize(torch.from_numpy(raw.copy()), qtype, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert bool(torch.isfinite(want).all())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # whole rows of it (a rank's shard) dequantize to those rows
    assert torch.equal(dequantize(torch.from_numpy(raw[1:3].copy()), qtype, (2, cols)), got[1:3])


def test_a_written_file_reads_back_its_tensors_shapes_and_bytes(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "ltxv")
    w = random_blocks("Q4_K", 6, 512, seed=3)
    writer.add_tensor("blocks.0.w", w, raw_dtype=gguf.GGMLQuantizationType.Q4_K)  # w: [rows, bytes]
    bias = np.arange(6, dtype=np.float32)
    writer.add_tensor("blocks.0.b", bias)
    writer.add_string("config", '{"transformer": {}}')
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.architecture == "ltxv" and f.field("config") == '{"transformer": {}}' and f.field("absent") is None
    assert {n: (t.qtype, t.shape) for n, t in f.tensors.items()} == {"blocks.0.w": ("Q4_K", (6, 512)),
                                                                       "blocks.0.b": ("F32", (6,))}
    assert f.read("blocks.0.w").shape == packed_shape("Q4_K", (6, 512)) == (6, 288)
    assert torch.equal(f.read("blocks.0.w"), torch.from_numpy(w))
    assert torch.equal(dequantize(f.read("blocks.0.b"), "F32", (6,)), torch.from_numpy(bias))


def test_what_is_not_read_is_refused_naming_it(tmp_path):
    with pytest.raises(GGMLFormatError, match="GGML type IQ2_XS is not read by ltx_mgpu; readable: F32, F16"):
        packed_shape("IQ2_XS", (4, 256))
    with pytest.raises(GGMLFormatError, match=r"rows must be whole 256-value blocks, got shape \(4, 100\)"):
        packed_shape("Q4_K", (4, 100))
    with pytest.raises(GGMLFormatError, match=r"takes 576 bytes, got 100 of torch.uint8"):
        dequantize(torch.zeros(100, dtype=torch.uint8), "Q4_K", (4, 256))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(GGMLFormatError, match="not a readable GGUF file"):
        GGUFFile(bad)
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "ltxv")
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL][1]
    writer.add_tensor("w", np.zeros((2, 256 // 32 * size), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGMLFormatError, match=r"tensor w is IQ4_NL, which ltx_mgpu does not read; readable: F32"):
        GGUFFile(path).read("w")
