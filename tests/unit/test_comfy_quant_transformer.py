"""Transformer files of ComfyUI's quantized layers (``ltx_mgpu.quantized.rows`` and the safetensors
side of ``ltx_mgpu.denoise.checkpoint``): the tiny LTX-2.3 with its block linears in nvfp4, int8
and int8 with ConvRot loads with them kept as packed rows, and computes what the same weights
dequantized into a float32 file compute; the rows dequantize to comfy-kitchen's own values; LoRAs
and ComfyUI's patches merge per call and come off exactly; a damaged file is refused naming the
layer."""

from __future__ import annotations

import pytest
import torch
from gguf_support import AV_ODD_CASE, REL, comfy_quant_pair, rel, wide_file
from safetensors.torch import load_file, save_file
from sp_harness import run_case

from ltx_mgpu.assets.comfy_quantized import block_linear_formats, export_comfy_quant
from ltx_mgpu.denoise.checkpoint import CheckpointError, inspect_checkpoint
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.patches import WeightPatch, apply_patches
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.quantized import rows
from ltx_mgpu.quantized.dequant import dequantize
from ltx_mgpu.quantized.encode import quantize_layer
from ltx_mgpu.quantized.layers import LayerQuant
from ltx_mgpu.quantized.packed import STORAGE_DTYPE, LoraDelta, PackedLinear, packed_shape

PACKED = {"nvfp4": "nvfp4", "mxfp8": "mxfp8", "int8": "int8_tensorwise", "int8_convrot": "int8_tensorwise+convrot256"}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return wide_file(tmp_path_factory.mktemp("wide"))


@pytest.mark.parametrize("quant, shape", [
    (LayerQuant("nvfp4"), (130, 200)),  # padded to 144 x 208 as stored
    (LayerQuant("nvfp4", pre_quant_scale=True), (64, 96)),
    (LayerQuant("nvfp4", pre_quant_scale=True), (30, 200)),  # padded columns and a scale per logical one
    (LayerQuant("mxfp8"), (70, 100)),  # padded to 96 x 128 as stored
    (LayerQuant("int8_tensorwise"), (33, 64)),
    (LayerQuant("int8_tensorwise", 64), (40, 128)),
    (LayerQuant("int8_tensorwise", 16), (7, 48)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_rows_dequantize_to_comfy_kitchens_own_values(quant, shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    parts = quantize_layer(torch.randn(*shape, generator=g) * 0.1, LayerQuant(quant.format, quant.convrot_groupsize))
    if quant.pre_quant_scale:
        parts["pre_quant_scale"] = torch.rand(shape[1], generator=g) + 0.5
    want = dequantize(quant, parts, dtype, shape)  # comfy-kitchen's eager functions, as ComfyUI computes it
    packed, tensor_scale, column_scale = rows.pack_rows(quant, parts, shape)
    assert tuple(packed.shape) == packed_shape(quant.describe(), shape) and packed.dtype == torch.uint8
    assert torch.equal(rows.dequantize(packed, quant.describe(), shape[1], dtype, tensor_scale, column_scale), want)
    # a shard's rows, read alone, are the same rows of the whole
    part = slice(3, 7)
    sharded = dict(parts, weight=parts["weight"][part])
    shard, *_ = rows.pack_rows(quant, sharded, shape, part)
    assert torch.equal(shard, packed[part])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "int8", "int8_convrot"])
def test_a_comfy_quantized_transformer_computes_what_its_dequantized_weights_compute(wide, tmp_path, fmt):
    path, reference = comfy_quant_pair(wide, tmp_path, fmt)
    info = inspect_checkpoint(path)
    assert info.quant and all(q.describe() == PACKED[fmt] for k, q in info.quant.items())
    assert info.shapes == inspect_checkpoint(reference).shapes  # the logical shapes
    packed = load_ltx_model(TransformerPlan(path, dtype="fp32"))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"))
    layers = [m for m in packed.transformer.modules() if isinstance(m, PackedLinear)]
    assert packed.plan.storage == "comfy_quant" and packed.linears == "packed" and layers
    assert all(m.qtype == PACKED[fmt] and m.weight.dtype == STORAGE_DTYPE for m in layers)
    held = sum(p.numel() * p.element_size() for p in packed.transformer.parameters())
    saving = sum(m.in_features * m.out_features * 4 - m.weight.numel() for m in layers)  # float32 less the rows
    assert held == sum(p.numel() * p.element_size() for p in dense.transformer.parameters()) - saving
    with torch.no_grad():
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
    for g, w in zip(got, want):
        assert rel(g, w) <= REL, fmt


def test_a_mixed_file_keeps_nvfp4_packed_and_dequantizes_its_fp8_and_other_layers(wide, tmp_path):
    # fp4_mixed as ComfyUI's Gemma file has it: nvfp4, fp8 and plain layers side by side; here also
    # a quantized layer outside the blocks (dequantized at load, as ComfyUI computes it)
    def rule(key, shape):
        if key == "proj_out.weight":
            return LayerQuant("int8_tensorwise")
        if key.startswith("transformer_blocks.0."):
            return block_linear_formats("fp8")(key, shape)
        return block_linear_formats("nvfp4")(key, shape)

    path = export_comfy_quant(wide, tmp_path / "mixed.safetensors", rule)
    from ltx_mgpu.assets.comfy_quantized import dequantized_copy

    reference = dequantized_copy(path, tmp_path / "mixed-reference.safetensors")
    packed = load_ltx_model(TransformerPlan(path, dtype="fp32"))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"))
    assert isinstance(packed.transformer.transformer_blocks[1].attn1.to_q, PackedLinear)
    assert type(packed.transformer.transformer_blocks[0].attn1.to_q) is torch.nn.Linear
    assert type(packed.transformer.proj_out) is torch.nn.Linear
    with torch.no_grad():
        for g, w in zip(run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)):
            assert rel(g, w) <= REL


def test_loras_and_comfyuis_patches_merge_into_packed_rows_and_come_off_exactly(wide, tmp_path):
    path, reference = comfy_quant_pair(wide, tmp_path, "int8_convrot")
    g = torch.Generator().manual_seed(2)
    lora = tmp_path / "lora.safetensors"
    stem = "diffusion_model.transformer_blocks.0.attn1.to_v"
    save_file({f"{stem}.lora_A.weight": torch.randn(4, 256, generator=g) / 16,
               f"{stem}.lora_B.weight": torch.randn(256, 4, generator=g)}, str(lora))
    packed = load_ltx_model(TransformerPlan(path, dtype="fp32", loras=[(lora, 0.7)]))
    dense = load_ltx_model(TransformerPlan(reference, dtype="fp32", loras=[(lora, 0.7)]))
    v = packed.transformer.transformer_blocks[0].attn1.to_v
    assert isinstance(v, PackedLinear) and len(v.loras) == 1 and isinstance(v.loras[0], LoraDelta)
    key = "diffusion_model.transformer_blocks.0.ff.net.2.weight"
    patches = {key: [WeightPatch("lora", 0.8, up=torch.randn(256, 4, generator=g),
                                 down=torch.randn(4, 1024, generator=g), alpha=2.0)]}
    ff = packed.transformer.transformer_blocks[0].ff.net[2]
    file_rows = ff.packed().clone()
    with torch.no_grad():
        before = run_case(packed.transformer, AV_ODD_CASE)
        for m in (packed, dense):
            apply_patches(m, patches)
        assert torch.equal(ff.packed(), file_rows)  # merged per call: the file's rows untouched
        got, want = run_case(packed.transformer, AV_ODD_CASE), run_case(dense.transformer, AV_ODD_CASE)
        for gv, w, b in zip(got, want, before):
            assert rel(gv, w) <= REL and rel(gv, b) > 100 * REL
        apply_patches(packed, {}, set(patches))
        for gv, b in zip(run_case(packed.transformer, AV_ODD_CASE), before):
            assert torch.equal(gv, b)


def test_dtype_fp8_is_refused_for_a_comfy_quantized_file(wide, tmp_path):
    path, _ = comfy_quant_pair(wide, tmp_path, "nvfp4")
    with pytest.raises(ValueError, match="ComfyUI-quantized .nvfp4 / int8. layers: its quantized blocks run with "
                                         "dtype bf16, fp16 or fp32"):
        TransformerPlan(path, dtype="fp8").with_storage("comfy_quant")


@pytest.mark.parametrize("fmt, tensor, value", [("nvfp4", "weight_scale_2", float("nan")),
                                                 ("nvfp4", "weight_scale", float("inf")),
                                                 ("mxfp8", "weight_scale", float("nan")),
                                                 ("int8_convrot", "weight_scale", float("nan"))])
@pytest.mark.parametrize("weights", ["replicated", "sharded-rows"])
def test_a_damaged_scale_is_refused_at_load_naming_the_layer(wide, tmp_path, fmt, tensor, value, weights):
    path, _ = comfy_quant_pair(wide, tmp_path, fmt)
    sd = load_file(str(path))
    key = f"transformer_blocks.1.attn2.to_k.{tensor}"
    t = sd[key]
    if t.dtype == torch.float8_e4m3fn:
        t = t.clone()
        t.view(torch.uint8)[0, 0] = 0x7F  # e4m3's NaN
    elif t.dtype == torch.uint8:
        t = t.clone()
        t[0, 0] = 0xFF  # E8M0's NaN
    else:
        t = t.clone()
        t.reshape(-1)[0] = value
    sd[key] = t
    save_file(sd, str(path), metadata={"config": __import__("json").dumps(inspect_checkpoint(wide).config)})
    if weights == "replicated":
        with pytest.raises(CheckpointError, match=r"transformer_blocks\.1\.attn2\.to_k\.weight\.weight_scale(_2)? "
                                                  "holds NaN or infinite values"):
            load_ltx_model(TransformerPlan(path, dtype="fp32"))
    else:  # a shard's rows of the same layer: the scales are checked whole
        quant = inspect_checkpoint(path).quant["transformer_blocks.1.attn2.to_k.weight"]
        parts = {"weight": sd["transformer_blocks.1.attn2.to_k.weight"][:2],
                 **{p: sd[f"transformer_blocks.1.attn2.to_k.{p}"] for p in quant.parts}}
        with pytest.raises(rows.RowFormatError, match="holds NaN or infinite values"):
            rows.pack_rows(quant, parts, (256, 256), slice(0, 2), where="L")


def test_row_format_names_and_their_errors():
    assert rows.parse("int8_tensorwise+convrot64") == LayerQuant("int8_tensorwise", 64)
    assert rows.parse("nvfp4+pre_quant_scale") == LayerQuant("nvfp4", pre_quant_scale=True)
    for bad in ("float8_e4m3fn", "nvfp4+convrot256", "int8_tensorwise+pre_quant_scale", "Q4_K", "mxfp8+convrot16"):
        assert not rows.is_row_format(bad)
        with pytest.raises(rows.RowFormatError, match="is not a packed row format"):
            rows.parse(bad)
    parts = quantize_layer(torch.randn(32, 64), LayerQuant("int8_tensorwise"))
    with pytest.raises(rows.RowFormatError, match=r"L\.weight_scale is \[3\]; an int8 scale is one number or one per "
                                                  "row"):
        rows.pack_rows(LayerQuant("int8_tensorwise"), dict(parts, weight_scale=torch.ones(3)), (32, 64), where="L")
    with pytest.raises(rows.RowFormatError, match=r"L\.weight has 32 rows; rows 0\.\.40"):
        rows.pack_rows(LayerQuant("int8_tensorwise"), parts, (40, 64), where="L")


@pytest.mark.parametrize("fmt, tensor, shape, match", [
    ("int8", "weight_scale", (257, 1), r"weight_scale is F32 \[257, 1\]; an int8_tensorwise weight scale is one number "
                                       r"or one per row \(\[256\] or \[256, 1\]\)"),
    ("nvfp4", "weight_scale_2", (3,), r"weight_scale_2 is F32 \[3\]; nvfp4's weight_scale_2 is one number"),
    ("nvfp4", "pre_quant_scale", (7,), r"pre_quant_scale is F32 \[7\]; nvfp4's pre_quant_scale is one per input "
                                       r"column \(\[256\]\)"),
], ids=["int8_scale_rows_plus_1", "nvfp4_scale_2_of_3", "nvfp4_pre_quant_7"])
def test_a_scale_of_the_wrong_shape_is_refused_from_the_header(wide, tmp_path, fmt, tensor, shape, match):
    """Refused by ``inspect_checkpoint`` (what the pool's ``load_transformer`` checks before any
    weight is read), naming the key and the fix, for replicated and sharded loads alike."""
    path, _ = comfy_quant_pair(wide, tmp_path, fmt)
    sd = load_file(str(path))
    sd[f"transformer_blocks.1.attn2.to_k.{tensor}"] = torch.ones(shape)
    save_file(sd, str(path), metadata={"config": __import__("json").dumps(inspect_checkpoint(wide).config)})
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.1\.attn2\.to_k\." + match) as e:
        inspect_checkpoint(path)
    assert "the file is damaged" in str(e.value)
