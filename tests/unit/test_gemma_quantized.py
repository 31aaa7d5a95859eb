"""ComfyUI's quantized Gemma files (``gemma_3_12B_it_fp4_mixed`` and its kin) in our loader.

The tiny Gemma is written in each of ``ltx_mgpu.assets.quant_plans.PLANS`` (comfy-kitchen's
quantizers, ComfyUI's markers), and the tests check:

* the files are in the layout ComfyUI saves (tensor names, dtypes, shapes, the marker's bytes);
* every quantized layer dequantizes to exactly what comfy-kitchen's own ``QuantizedTensor`` gives
  with the parameters ComfyUI builds for it (``comfy/ops.py`` ``_load_quantized_module``), int8
  and ConvRot included, which ComfyUI 0.20.1 itself does not load (``tests/comfyui/test_comfyui_clip.py``
  compares nvfp4 and fp8 with ComfyUI's own text encoder);
* each file loads in bf16 and in NF4 (the NF4 made from the same dense weights as bf16), and
  stays close to the bf16 model; the older ``_quantization_metadata`` header reads as markers do;
* the identity covers the decoding; a format we cannot read is refused, named, with the fix,
  from the header, before anything is loaded.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from gemma_support import assert_identical, hidden
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.assets.gemma import build_tiny_gemma_comfy_file
from ltx_mgpu.assets.quant_plans import PLANS
from ltx_mgpu.quantized import dequant as dq
from ltx_mgpu.quantized.encode import quantize_layer
from ltx_mgpu.quantized.layers import LayerQuant
from ltx_mgpu.text.cache.keys import cache_key_parts
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.placement import read_gemma_shape
from ltx_mgpu.text.gemma.comfy_file import open_comfy_file
from ltx_mgpu.text.gemma.sources import GemmaFormatError, GemmaWeightsError, detect_gemma_format, gemma_identity
from ltx_mgpu.text.nf4.artifact import read_manifest
from ltx_mgpu.text.nf4.model import nf4_linears
from ltx_mgpu.text.nf4.quantize import quantize_nf4, quantize_tensor

#: Mean per-token cosine to the bf16 model, worst hidden state, tiny random model (bf16 compute).
#: Measured on the seed-0 tiny Gemma with gemma_support.PROMPTS: nvfp4 0.915, fp4_mixed 0.972,
#: fp8 0.992, int8 0.9990, int8_convrot 0.9992 loaded in bf16; 0.83-0.91 through NF4 (NF4 of the
#: bf16 model itself: 0.88; random weights are poor 4-bit references, tests/unit/test_nf4_fidelity.py).
#: Bounds with margin:
BF16_BOUND = {"nvfp4": 0.85, "fp4_mixed": 0.92, "fp8": 0.98, "int8": 0.995, "int8_convrot": 0.995}
NF4_BOUND = 0.72
LAYER = "model.layers.2.self_attn.k_proj"  # 32 x 64: rows below the scales' 128-row tile


@pytest.fixture(scope="module")
def files(gemma, tmp_path_factory):
    d = tmp_path_factory.mktemp("quantized")
    out = {}
    for plan in PLANS:
        out[plan] = d / f"tiny-gemma-{plan}.safetensors"
        build_tiny_gemma_comfy_file(gemma["snapshot"], out[plan], plan)
    return out


def _cosines(tower, base):
    h, mask = hidden(tower)
    m = mask.bool()
    return [float(torch.nn.functional.cosine_similarity(a[m].float(), b[m].float(), dim=-1).mean())
            for a, b in zip(h, base)]


def _rewrite(src, dst, tensors=None, metadata=None):
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
    save_file(tensors if tensors is not None else load_file(str(src)), str(dst),
              metadata=meta if metadata is None else metadata)
    return dst


# --------------------------------------------------------------------------- the files


def test_files_are_in_comfyuis_saved_layout(files):
    with safe_open(str(files["nvfp4"]), "pt") as f:
        keys = set(f.keys())
        assert {k for k in keys if k.startswith(LAYER + ".")} == {
            f"{LAYER}.{s}" for s in ("weight", "weight_scale", "weight_scale_2", "comfy_quant")}
        assert f.get_tensor(f"{LAYER}.comfy_quant").numpy().tobytes() == b'{"format": "nvfp4"}'
        w, s, s2 = (f.get_tensor(f"{LAYER}.{n}") for n in ("weight", "weight_scale", "weight_scale_2"))
        assert (w.dtype, tuple(w.shape)) == (torch.uint8, (32, 32))  # two e2m1 per byte
        assert (s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (128, 4))  # 128 x 4 tiles of 4 = 64/16
        assert (s2.dtype, s2.dim()) == (torch.float32, 0)
        assert f.get_tensor("model.layers.2.input_layernorm.weight").dtype == torch.bfloat16
        assert "model.embed_tokens.comfy_quant" not in keys and "vision_model.head.comfy_quant" not in keys
    with safe_open(str(files["int8_convrot"]), "pt") as f:
        assert f.get_tensor(f"{LAYER}.comfy_quant").numpy().tobytes() == (
            b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 64}')
        assert f.get_tensor(f"{LAYER}.weight").dtype == torch.int8
        assert tuple(f.get_tensor(f"{LAYER}.weight_scale").shape) == (32, 1)  # per row
    with safe_open(str(files["int8"]), "pt") as f:
        assert f.get_tensor(f"{LAYER}.weight_scale").dim() == 0  # one per tensor
    mixed = open_comfy_file(files["fp4_mixed"]).quant
    assert mixed.of("model.layers.0.mlp.up_proj.weight") is None
    assert mixed.of("model.layers.3.mlp.up_proj.weight") == LayerQuant("nvfp4")
    assert mixed.of("model.layers.5.mlp.up_proj.weight") == LayerQuant("float8_e4m3fn")
    assert mixed.describe() == "float8_e4m3fn,nvfp4"


def test_files_are_deterministic(files, gemma, tmp_path):
    again = tmp_path / "again.safetensors"
    build_tiny_gemma_comfy_file(gemma["snapshot"], again, "fp4_mixed")
    assert again.read_bytes() == files["fp4_mixed"].read_bytes()


def _comfy_kitchen_dense(quant, parts, shape, dtype=torch.bfloat16):
    """What ComfyUI computes with for activations of ``dtype``: comfy-kitchen's QuantizedTensor with
    ComfyUI's Params for the layer (``comfy/ops.py``), cast to ``dtype``, dequantized."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    layout = {"nvfp4": "TensorCoreNVFP4Layout", "int8_tensorwise": "TensorWiseINT8Layout"}.get(
        quant.format, "TensorCoreFP8Layout")
    kwargs = {"scale": parts["weight_scale"]}
    if quant.format == "nvfp4":
        kwargs = {"scale": parts["weight_scale_2"], "block_scale": parts["weight_scale"]}
    if quant.convrot_groupsize:
        kwargs.update(convrot=True, convrot_groupsize=quant.convrot_groupsize)
    params = get_layout_class(layout).Params(**kwargs, orig_dtype=torch.bfloat16, orig_shape=shape)
    return QuantizedTensor(parts["weight"], layout, params).to(dtype=dtype).dequantize()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("plan", PLANS)
def test_every_layer_dequantizes_as_comfy_kitchen_does_for_comfyui(files, plan, dtype):
    src = open_comfy_file(files[plan])
    tensors = load_file(str(files[plan]))
    for layer, quant in src.quant.layers.items():
        parts = {"weight": tensors[layer + ".weight"], **{p: tensors[f"{layer}.{p}"] for p in quant.parts}}
        shape = src.shapes[layer[len("model."):] + ".weight"]
        theirs = _comfy_kitchen_dense(quant, parts, shape, dtype)
        ours = src.read(layer[len("model."):] + ".weight", dtype=dtype)
        assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs), layer
    assert len(src.quant.layers) == (5 if plan == "fp4_mixed" else 6) * 7  # fp4_mixed: layer 0 stays plain


def test_nvfp4_padding_is_cut_and_pre_quant_scale_folded():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20, 40, generator=g) * 0.05
    parts = quantize_layer(w, LayerQuant("nvfp4"))
    assert tuple(parts["weight"].shape) == (32, 24)  # padded to 32 x 48, two per byte
    dense = dq.dequantize(LayerQuant("nvfp4"), parts, torch.float32, shape=(20, 40))
    assert torch.equal(dense, _comfy_kitchen_dense(LayerQuant("nvfp4"), parts, (20, 40), torch.float32))
    assert tuple(dense.shape) == (20, 40) and float((dense - w).norm() / w.norm()) < 0.15
    smooth = torch.rand(48, generator=g) + 0.5
    folded = dq.dequantize(LayerQuant("nvfp4", pre_quant_scale=True), {**parts, "pre_quant_scale": smooth},
                           torch.float32, shape=(20, 40))
    x = torch.randn(3, 40, generator=g)
    # later ComfyUI multiplies the input by pre_quant_scale before the layer; folded into the columns:
    torch.testing.assert_close(x @ folded.T, (x * smooth[:40]) @ dense.T, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("plan", PLANS)
def test_each_format_loads_in_bf16_and_nf4(files, gemma, plan):
    base, _ = hidden(gemma["tower"])
    tower = load_gemma_text_tower(files[plan])
    assert tower.format == "comfy_file" and tower.weights == "bf16"
    assert {p.dtype for p in tower.model.parameters()} == {torch.bfloat16}
    cos = _cosines(tower, base)
    assert min(cos) >= BF16_BOUND[plan] and max(cos) <= 1.0 + 1e-6, cos
    assert not all(c > 0.99999 for c in cos[1:])  # really quantized, not bypassed
    nf4 = load_gemma_text_tower(files[plan], weights="nf4")
    assert nf4.weights == "nf4" and nf4.identity == tower.identity == gemma_identity(files[plan])
    cos = _cosines(nf4, base)
    assert min(cos) >= NF4_BOUND and all(math.isfinite(c) for c in cos), cos
    # NF4 is made from the dense weights the bf16 load computes with
    dense = dict(tower.model.named_parameters())
    for name, module in nf4_linears(nf4.model).items():
        again = quantize_tensor(f"{name}.weight", dense[f"{name}.weight"], torch.device("cpu"))
        assert torch.equal(module.weight.data, again[f"{name}.weight"]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loader_dequantizes_into_its_dtype(files, dtype):
    """ComfyUI dequantizes into its activations' dtype: a bf16 load gets its bf16 weights, an fp32
    one (as ComfyUI's text encoder computes on the CPU) its fp32 weights."""
    src = open_comfy_file(files["fp4_mixed"])
    tower = load_gemma_text_tower(files["fp4_mixed"], dtype=dtype)
    for name, p in tower.model.named_parameters():
        assert p.dtype == dtype and torch.equal(p, src.read(name, dtype=dtype).to(dtype)), name


def test_nf4_artifact_of_a_quantized_file(files, tmp_path):
    out = quantize_nf4(files["fp4_mixed"], tmp_path / "nf4", device="cpu")
    source = read_manifest(out)["source"]
    assert source == {"format": "comfy_file", "name": files["fp4_mixed"].name,
                      "identity": gemma_identity(files["fp4_mixed"]), "stored_as": "float8_e4m3fn,nvfp4"}
    assert_identical(hidden(load_gemma_text_tower(out))[0],
                     hidden(load_gemma_text_tower(files["fp4_mixed"], weights="nf4"))[0])


def test_old_quantization_metadata_header_reads_as_markers(files, tmp_path):
    tensors = load_file(str(files["fp4_mixed"]))
    with safe_open(str(files["fp4_mixed"]), "pt") as f:
        meta = dict(f.metadata())
    layers = {k[: -len(".comfy_quant")]: json.loads(tensors.pop(k).numpy().tobytes())
              for k in [k for k in tensors if k.endswith(".comfy_quant")]}
    meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    old = _rewrite(files["fp4_mixed"], tmp_path / "old.safetensors", tensors, meta)
    assert open_comfy_file(old).quant == open_comfy_file(files["fp4_mixed"]).quant
    assert_identical(hidden(load_gemma_text_tower(old))[0], hidden(load_gemma_text_tower(files["fp4_mixed"]))[0])


# --------------------------------------------------------------------------- identity


def test_identity_covers_the_decoding(files, gemma, tiny_ltx_23, monkeypatch):
    before = {plan: gemma_identity(path) for plan, path in files.items()}
    plain = gemma_identity(gemma["comfy"])
    assert len(set(before.values())) == len(PLANS)
    parts = cache_key_parts(TextEncoderConfig(str(files["nvfp4"]), str(tiny_ltx_23)))
    assert parts.gemma_identity == before["nvfp4"]  # the cache key's
    monkeypatch.setattr(dq, "DECODER", "comfy-kitchen-eager.999")  # a new way of decoding them
    assert all(gemma_identity(path) != before[plan] for plan, path in files.items())
    assert gemma_identity(gemma["comfy"]) == plain  # a file without quantized layers keeps its identity


# --------------------------------------------------------------------------- refusals


def _marked(files, tmp_path, layer_conf=None, drop=(), raw=None):
    tensors = load_file(str(files["nvfp4"]))
    key = f"{LAYER}.comfy_quant"
    if layer_conf is not None:
        tensors[key] = torch.tensor(list(json.dumps(layer_conf).encode()), dtype=torch.uint8)
    if raw is not None:
        tensors[key] = torch.tensor(list(raw), dtype=torch.uint8)
    for k in drop:
        del tensors[k]
    return _rewrite(files["nvfp4"], tmp_path / "bad.safetensors", tensors)


@pytest.mark.parametrize(("change", "match"), [
    ({"layer_conf": {"format": "svdquant_w4a4"}}, r"k_proj is stored as ComfyUI 'svdquant_w4a4' \(SVDQuant.*cannot "
                                                  r"read yet.*gemma_3_12B_it_fp4_mixed"),
    ({"layer_conf": {"format": "nvfp6"}}, r"unknown quantization format 'nvfp6'.*reads nvfp4, float8_e4m3fn"),
    ({"layer_conf": {"format": "int8_tensorwise"}}, r"marked 'int8_tensorwise'.*I8.*is U8"),
    ({"raw": b"nvfp4"}, r"comfy_quant marker is not ComfyUI's JSON"),
    ({"drop": (f"{LAYER}.weight_scale_2",)}, r"k_proj.weight_scale_2 is missing"),
])
def test_an_unreadable_format_is_refused_from_the_header_with_the_fix(files, tiny_ltx_23, tmp_path, change,
                                                                     match):
    bad = _marked(files, tmp_path, **change)
    # the pool's request check (read_gemma_shape), the client's cache lookup, the loader
    for check in (detect_gemma_format, read_gemma_shape, gemma_identity, load_gemma_text_tower,
                  lambda p: cache_key_parts(TextEncoderConfig(str(p), str(tiny_ltx_23)))):
        with pytest.raises(GemmaFormatError, match=match):
            check(bad)


def test_a_vision_tower_in_another_format_does_not_block_the_text_tower(files, tmp_path):
    tensors = load_file(str(files["nvfp4"]))
    vision = next(k for k in tensors if k.startswith("vision_model.") and k.endswith(".weight"))
    tensors[vision[: -len(".weight")] + ".comfy_quant"] = torch.tensor(list(b'{"format": "awq_w4a16"}'),
                                                                       dtype=torch.uint8)
    ok = _rewrite(files["nvfp4"], tmp_path / "vision.safetensors", tensors)
    assert detect_gemma_format(ok) == "comfy_file"


# --------------------------------------------------------------------------- lying files (issue 29)


def _with(files, tmp_path, plan, **tensors):
    """``plan``'s file with ``LAYER``'s tensors ``<name>=value`` replaced (or added)."""
    sd = load_file(str(files[plan]))
    sd.update({f"{LAYER}.{name}": t for name, t in tensors.items()})
    return _rewrite(files[plan], tmp_path / f"{plan}-bad.safetensors", sd)


@pytest.mark.parametrize(("plan", "tensors", "match"), [
    ("fp8", {"weight_scale": torch.ones(5)}, r"k_proj\.weight_scale is F32 \[5\]; a float8_e4m3fn weight scale is "
                                             r"one number or one per row \(\[32\] or \[32, 1\]\)"),
    ("int8", {"weight_scale": torch.ones(33, 1)}, r"k_proj\.weight_scale is F32 \[33, 1\]; an int8_tensorwise weight "
                                                  r"scale is one number or one per row \(\[32\] or \[32, 1\]\)"),
    ("nvfp4", {"pre_quant_scale": torch.ones(7)}, r"k_proj\.pre_quant_scale is F32 \[7\]; nvfp4's pre_quant_scale is "
                                                  r"one per input column \(\[64\]\)"),
    ("nvfp4", {"weight_scale_2": torch.ones(3)}, r"k_proj\.weight_scale_2 is F32 \[3\]; nvfp4's weight_scale_2 is one "
                                                 r"number"),
], ids=["fp8_scale_5", "int8_scale_rows_plus_1", "nvfp4_pre_quant_7", "nvfp4_scale_2_of_3"])
def test_a_scale_of_the_wrong_shape_is_refused_from_the_header_naming_it(files, tmp_path, tiny_ltx_23, plan, tensors,
                                                                        match):
    bad = _with(files, tmp_path, plan, **tensors)
    for check in (detect_gemma_format, read_gemma_shape, load_gemma_text_tower,
                  lambda p: cache_key_parts(TextEncoderConfig(str(p), str(tiny_ltx_23)))):
        with pytest.raises(GemmaFormatError, match=match) as e:
            check(bad)
        assert "the file is damaged" in str(e.value)


@pytest.mark.parametrize(("plan", "name", "value"), [
    ("nvfp4", "weight_scale_2", float("nan")), ("nvfp4", "weight_scale_2", float("inf")),
    ("fp8", "weight_scale", float("nan")), ("int8", "weight_scale", float("inf")),
])
@pytest.mark.parametrize("weights", ["bf16", "nf4"])
def test_a_non_finite_scale_is_refused_at_load_naming_the_layer(files, tmp_path, plan, name, value, weights):
    with safe_open(str(files[plan]), "pt") as f:
        scale = f.get_tensor(f"{LAYER}.{name}").clone()
    scale.reshape(-1)[0] = value
    bad = _with(files, tmp_path, plan, **{name: scale})
    with pytest.raises(Exception, match=rf"{LAYER}\.weight .*holds NaN or infinite values; the file is damaged"):
        if weights == "bf16":
            load_gemma_text_tower(bad, dtype=torch.float32)
        else:
            quantize_nf4(bad, tmp_path / "nf4", device="cpu")


@pytest.mark.parametrize(("value", "error", "match"), [
    ("{not json", GemmaFormatError, r"'ltx_mgpu_gemma_config' metadata is not JSON"),
    ("[" * 100_000, GemmaFormatError, r"'ltx_mgpu_gemma_config' metadata is not JSON"),
    ('["a list"]', GemmaFormatError, r"'ltx_mgpu_gemma_config' metadata is not a JSON object"),
    (json.dumps({"hidden_size": "wide"}), GemmaFormatError,
     r"'ltx_mgpu_gemma_config' metadata does not describe a Gemma 3 text model"),
    (json.dumps({"hidden_size": 4096}), GemmaWeightsError,
     r"'ltx_mgpu_gemma_config' metadata says hidden_size 4096, the weights 64"),
    (json.dumps({"x": "y" * (90 << 20)}), GemmaFormatError,
     r"'ltx_mgpu_gemma_config' metadata is 94371849 bytes, more than 1048576"),
], ids=["malformed", "deep", "list", "wrong_type", "contradicts_weights", "90_mb"])
def test_a_malformed_config_in_the_header_is_refused_naming_it(files, tmp_path, value, error, match):
    with safe_open(str(files["nvfp4"]), "pt") as f:
        meta = dict(f.metadata())
    bad = _rewrite(files["nvfp4"], tmp_path / "meta.safetensors", metadata={**meta, "ltx_mgpu_gemma_config": value})
    for check in (read_gemma_shape, load_gemma_text_tower):
        with pytest.raises(error, match=match) as e:
            check(bad)
        assert str(bad) in str(e.value)
