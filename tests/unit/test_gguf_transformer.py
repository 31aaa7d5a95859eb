"""GGUF transformer files (``ltx_mgpu.quantized.packed`` and the GGUF side of
``ltx_mgpu.denoise.checkpoint``): the tiny LTX-2.3 (and 2.0) written as GGUF in each GGML type loads with
its block linears kept packed, and computes what the same weights dequantized into a float32
file compute (fp32, 1e-5); LoRAs merge per call as they merge into a dense weight; what cannot
be read is refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from gguf_support import AV_ODD_CASE, REL, gguf_pair, rel, wide_file
from safetensors.torch import save_file
from sp_harness import run_case

from ltx_mgpu.assets.ggml_export import block_linear_types, export_gguf
from ltx_mgpu.denoise.checkpoint import CheckpointError, inspect_checkpoint
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.patches import PatchError, WeightPatch, apply_patches
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.quantized.ggml import READABLE, dequantize, packed_shape
from ltx_mgpu.quantized.packed import STORAGE_DTYPE, LoraDelta, PackedLinear


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The wide tiny model as a float32 transformer-only file (no connectors)."""
    return wide_file(tmp_path_factory.mktemp("wide"))


@pytest.mark.parametrize("qtype", [t for t in READABLE if t != "F32"])
def test_a_gguf_transformer_computes_what_its_dequantized_weights_compute(wide, tmp_path, qtype):
    gguf_path, reference = gguf_pair(wide, tmp_path, qtype)
    info = inspect_checkpoint(gguf_path)
    assert info.is_gguf and info.config_source == "metadata" and info.version == "2.3"
    packed = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32"))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"))
    layers = [m for m in packed.transformer.modules() if isinstance(m, PackedLinear)]
    if qtype in ("F16", "BF16"):  # not a packed type: read dense
        assert packed.linears == "dense" and not layers
    else:
        assert packed.plan.storage == "ggml" and packed.linears == "packed" and layers
        assert all(m.qtype == qtype and m.weight.dtype == STORAGE_DTYPE for m in layers)
        held = sum(p.numel() * p.element_size() for p in packed.transformer.parameters())
        assert held < sum(p.numel() * p.element_size() for p in dense.transformer.parameters())
    with torch.no_grad():
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
    for g, w in zip(got, want):
        assert rel(g, w) <= REL, qtype


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_an_ltx_2_0_gguf_transformer_computes_what_its_dequantized_weights_compute(tmp_path, qtype):
    gguf_path, reference = gguf_pair(wide_file(tmp_path, "2.0"), tmp_path, qtype)
    assert inspect_checkpoint(gguf_path).version == "2.0"
    packed = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32"))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"))
    assert packed.linears == "packed"
    with torch.no_grad():
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
    for g, w in zip(got, want):
        assert rel(g, w) <= REL


def test_a_loras_merge_into_a_packed_weight_as_into_the_dense_one(wide, tmp_path):
    gguf_path, reference = gguf_pair(wide, tmp_path, "Q4_K")
    g = torch.Generator().manual_seed(2)
    lora = tmp_path / "lora.safetensors"
    factors = {}
    for block in (0, 1):
        for m, (o, i) in {"attn1.to_q": (256, 256), "attn1.to_v": (256, 256), "attn1.to_out.0": (256, 256),
                          "ff.net.2": (256, 1024), "audio_ff.net.2": (256, 1024)}.items():
            stem = f"diffusion_model.transformer_blocks.{block}.{m}"
            factors[f"{stem}.lora_A.weight"] = torch.randn(4, i, generator=g) / i ** 0.5
            factors[f"{stem}.lora_B.weight"] = torch.randn(o, 4, generator=g)
    save_file(factors, str(lora))
    packed = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32", loras=[(lora, 0.7)]))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32", loras=[(lora, 0.7)]))
    plain = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32"))
    q = packed.transformer.transformer_blocks[0].attn1.to_q
    assert isinstance(q, PackedLinear) and len(q.loras) == 1 and isinstance(q.loras[0], LoraDelta)
    with torch.no_grad():
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
        base = run_case(plain.transformer, AV_ODD_CASE)
    for gv, w, b in zip(got, want, base):
        assert rel(gv, w) <= REL
        assert rel(b, w) > 100 * REL  # the LoRA matters: the parity is not vacuous
    # the file's bytes are untouched by the merge: the plain load holds the same ones
    assert torch.equal(q.packed(), plain.transformer.transformer_blocks[0].attn1.to_q.packed())


def test_comfyuis_patches_merge_into_packed_weights_per_call_and_come_off_exactly(wide, tmp_path):
    gguf_path, reference = gguf_pair(wide, tmp_path, "Q5_K")
    packed = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32"))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"))
    g = torch.Generator().manual_seed(3)
    key_q, key_ff = ("diffusion_model.transformer_blocks.1.attn1.to_q.weight",
                     "diffusion_model.transformer_blocks.0.ff.net.2.weight")
    patches = {
        key_q: [WeightPatch("lora", 0.8, up=torch.randn(256, 4, generator=g), down=torch.randn(4, 256, generator=g),
                            alpha=2.0)],
        key_ff: [WeightPatch("diff", 0.5, strength_model=0.9, diff=torch.randn(256, 1024, generator=g)),
                 WeightPatch("lora", 1.0, up=torch.randn(256, 2, generator=g), down=torch.randn(2, 1024, generator=g))],
    }
    q = packed.transformer.transformer_blocks[1].attn1.to_q
    file_bytes = q.packed().clone()
    with torch.no_grad():
        before = run_case(packed.transformer, AV_ODD_CASE)
        keys = apply_patches(packed, patches)
        assert apply_patches(dense, patches) == keys == {key_q, key_ff}
        assert len(q.patches) == 1 and torch.equal(q.packed(), file_bytes)  # merged per call, bytes untouched
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
        for gv, w, b in zip(got, want, before):
            assert rel(gv, w) <= REL and rel(gv, b) > 100 * REL
        apply_patches(packed, {}, keys)  # every patch off: the file's weights
        assert q.patches == () and torch.equal(q.packed(), file_bytes)
        for gv, b in zip(run_case(packed.transformer, AV_ODD_CASE), before):
            assert torch.equal(gv, b)
    wrong = {key_q: [WeightPatch("diff", 1.0, diff=torch.zeros(256, 128))]}
    with pytest.raises(PatchError, match=r"does not fit the weight's \(256, 256\)"):  # the logical shape
        apply_patches(packed, wrong)


def test_a_packed_layer_is_its_dequantized_linear(tmp_path):
    rows, cols = 8, 256
    g = torch.Generator().manual_seed(0)
    layer = PackedLinear(cols, rows, True, torch.float32, "Q8_0")
    import gguf

    values = torch.randn(rows, cols, generator=g).numpy()
    data = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).copy())
    assert tuple(data.shape) == packed_shape("Q8_0", (rows, cols))
    with torch.no_grad():
        layer.packed().copy_(data)
        layer.bias.copy_(torch.randn(rows, generator=g))
    x = torch.randn(3, 5, cols, generator=g)
    w = dequantize(data, "Q8_0", (rows, cols))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, layer.bias))
    up, down = torch.randn(rows, 2, generator=g), torch.randn(2, cols, generator=g)
    layer.loras = (LoraDelta(up, down, 0.5),)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w + 0.5 * (up @ down), layer.bias))


def test_a_gguf_file_that_is_not_a_transformer_or_holds_nan_is_refused_naming_it(wide, tmp_path):
    import gguf

    text = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(text), "gemma3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma3', not an LTX-2 transformer"):
        inspect_checkpoint(text)
    bad = tmp_path / "nan.gguf"
    export_gguf(wide, bad, block_linear_types("Q8_0"))
    # poison the fp16 scale of one Q8_0 block with NaN (0x7e00)
    tensor = next(t for t in gguf.GGUFReader(str(bad)).tensors if t.tensor_type.name == "Q8_0")
    raw = bytearray(bad.read_bytes())
    raw[tensor.data_offset:tensor.data_offset + 2] = b"\x00\x7e"
    bad.write_bytes(bytes(raw))
    assert inspect_checkpoint(bad).ggml_types[tensor.name] == "Q8_0"  # the header is fine
    iq4 = tmp_path / "iq4.gguf"  # a type llama.cpp has and ltx_mgpu does not read: refused at the header
    writer = gguf.GGUFWriter(str(iq4), "ltxv")
    writer.add_tensor("transformer_blocks.0.attn1.to_q.weight", torch.zeros(256, 136, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(CheckpointError, match="tensor transformer_blocks.0.attn1.to_q.weight is IQ4_XS, which "
                                              "ltx_mgpu does not read"):
        inspect_checkpoint(iq4)
    with pytest.raises(CheckpointError, match=rf"tensor {tensor.name} holds NaN or infinite values"):
        load_ltx_model(TransformerPlan(bad, dtype="fp32"))
