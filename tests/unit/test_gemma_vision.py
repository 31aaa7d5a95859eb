"""Gemma 3's vision tower from a Gemma source (``ltx_mgpu.text.gemma.vision``) and ComfyUI's image
preparation (``ltx_mgpu.text.generate.image``), in one process on the tiny Gemma.

* the ComfyUI file and the snapshot give the same tower (its config from the file's metadata);
  its soft tokens are transformers' ``Gemma3ForConditionalGeneration.get_image_features`` with
  ComfyUI's epsilons, image after image;
* a file without the tower (a text-only ComfyUI file, a GGUF) has none; a tower without its
  projector, a vision weight in int16 without a marker, a ComfyUI file whose tower does not fit
  ComfyUI's 12B defaults with no config stored, are refused naming the fix;
* a quantized vision layer (ComfyUI's marker) is read dequantized; a NaN or an infinity in a
  vision weight, the projector or a quantized layer's scale is refused at load, naming the tensor;
* the tokenizer's resize keeps the aspect ratio at about 896 x 896 pixels (ComfyUI's rounding);
  the model's step gives the tower's square, normalized, image by image as ComfyUI's batch; bad
  images are refused naming the fix: a strip of more than 16 to 1 (whose resize for a 896-pixel
  tower would take gigabytes), an image larger than the tokenizer leaves one (the pool's check),
  and the finite check allocates nothing of the image's size.

Against ComfyUI's own code: tests/comfyui/test_comfyui_generate.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.assets.ggml_export import export_gemma_gguf
from ltx_mgpu.quantized.dequant import dequantize
from ltx_mgpu.quantized.encode import quantize_layer
from ltx_mgpu.quantized.layers import LayerQuant
from ltx_mgpu.text.gemma.sources import GemmaFormatError, GemmaWeightsError
from ltx_mgpu.text.gemma.vision import COMFY_LAYER_NORM_EPS, VISION_CONFIG_METADATA_KEY, find_vision, load_vision
from ltx_mgpu.text.generate.image import (
    MAX_ASPECT,
    MAX_IMAGES,
    TOKENIZER_PIXELS,
    check_image,
    check_tokenized,
    tokenizer_image,
    vision_pixels,
)


def _text_config(snapshot):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(snapshot)).text_config


def _rewrite(src, dst, keep=lambda k: True, metadata=lambda m: m):
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata() or {})
    save_file({k: v for k, v in load_file(str(src)).items() if keep(k)}, str(dst), metadata=metadata(meta))
    return dst


def test_the_comfy_file_and_the_snapshot_give_transformers_image_features(tiny_gemma_dir, tiny_gemma_comfy_file):
    from transformers import Gemma3ForConditionalGeneration

    config = json.loads((tiny_gemma_dir / "config.json").read_text())
    comfy, snapshot = find_vision(tiny_gemma_comfy_file), find_vision(tiny_gemma_dir)
    for source in (comfy, snapshot):
        assert source.mm_tokens_per_image == config["mm_tokens_per_image"] == 4
        assert source.vision_config.num_attention_heads == config["vision_config"]["num_attention_heads"]
        assert source.image_size == 28 and source.vision_config.layer_norm_eps == COMFY_LAYER_NORM_EPS
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir), dtype=torch.float32).eval()
    for module in hf.model.vision_tower.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = COMFY_LAYER_NORM_EPS
    hf.model.multi_modal_projector.mm_soft_emb_norm.eps = hf.config.text_config.rms_norm_eps
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf.model.get_image_features(pixels).pooler_output.reshape(-1, 64)
        for source in (comfy, snapshot):
            got = load_vision(source, _text_config(tiny_gemma_dir))(pixels)
            assert got.shape == (8, 64) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1  # the tiny projector is not zero: images reach the text


def test_a_file_without_the_tower_has_none_and_a_tower_off_comfyuis_defaults_is_refused(tiny_gemma_dir,
                                                                                       tiny_gemma_comfy_file,
                                                                                       tmp_path):
    text_only = _rewrite(tiny_gemma_comfy_file, tmp_path / "text.safetensors",
                         keep=lambda k: not k.startswith(("vision_model.", "multi_modal_projector.")))
    assert find_vision(text_only) is None
    assert find_vision(export_gemma_gguf(tiny_gemma_dir, tmp_path / "tiny.gguf", "Q8_0")) is None  # mmproj apart
    no_projector = _rewrite(tiny_gemma_comfy_file, tmp_path / "half.safetensors",
                            keep=lambda k: not k.startswith("multi_modal_projector."))
    with pytest.raises(GemmaFormatError, match="no multi-modal projector"):
        find_vision(no_projector)
    odd = tmp_path / "int16.safetensors"
    tensors = load_file(str(tiny_gemma_comfy_file))
    tensors["vision_model.encoder.layers.0.mlp.fc1.weight"] = tensors[
        "vision_model.encoder.layers.0.mlp.fc1.weight"].to(torch.int16)
    with safe_open(str(tiny_gemma_comfy_file), "pt") as f:
        save_file(tensors, str(odd), metadata=dict(f.metadata()))
    with pytest.raises(GemmaFormatError, match="fc1.weight is stored as I16 without a ComfyUI comfy_quant"):
        find_vision(odd)
    bare = _rewrite(tiny_gemma_comfy_file, tmp_path / "bare.safetensors",
                    metadata=lambda m: {k: v for k, v in m.items() if k != VISION_CONFIG_METADATA_KEY})
    with pytest.raises(GemmaFormatError, match="256 image tokens per image do not pool.*2x2 patches"):
        find_vision(bare)  # ComfyUI's 12B defaults: 256 tokens per image


def test_the_tokenizer_resize_keeps_the_aspect_at_896_squared():
    image = torch.rand(1, 37, 53, 4)
    out = tokenizer_image(image)
    scale = math.sqrt(TOKENIZER_PIXELS / (37 * 53))
    assert out.shape == (1, round(37 * scale), round(53 * scale), 3) and out.dtype == torch.float32
    flat = tokenizer_image(torch.full((2, 10, 30, 3), 0.25))
    assert flat.shape[0] == 2 and torch.allclose(flat, torch.full_like(flat, 0.25))


def test_the_model_step_crops_the_centre_and_normalizes():
    wide = torch.zeros(1, 40, 80, 3)
    wide[:, :, 20:60] = 1.0  # a white centre half as wide as the image
    x = vision_pixels(wide, 28)
    assert x.shape == (1, 3, 28, 28)
    assert x.min() >= -1 and x.max() <= 1 and torch.allclose(x[..., 14], torch.ones(1, 3, 28))
    same = vision_pixels(torch.full((1, 28, 28, 3), 0.5), 28)
    assert torch.allclose(same, torch.full_like(same, (128 / 255 - 0.5) / 0.5), atol=1e-6)  # 255 x 0.5 rounds to 128


@pytest.mark.parametrize(("image", "match"), [
    ([[0.0]], "must be a ComfyUI IMAGE"),
    (torch.zeros(8, 8, 3), "floating tensor"),
    (torch.zeros(1, 8, 8, 3, dtype=torch.uint8), "floating tensor"),
    (torch.zeros(1, 8, 8, 1), "RGB images"),
    (torch.zeros(MAX_IMAGES + 1, 4, 4, 3), "at most"),
    (torch.tensor(float("inf")).expand(1, 4, 4, 3), "NaN or infinite"),
])
def test_bad_images_are_refused_with_the_fix(image, match):
    with pytest.raises(ValueError, match=match):
        check_image(image)


@pytest.mark.parametrize("shape", [(1, 1, 1000, 3), (2, 4000, 3, 3), (1, 1, 4_000_000, 3)])
def test_a_strip_is_refused_before_its_resize_would_take_gigabytes(shape):
    """A 1 x 1000 strip: step 1 makes it 28 x 28,334, step 2 (image size 896) 896 x 906,688 float32
    pixels, 9.7 GB per image, on the pool's GPU (before: allocated; 1 x 4,000,000 rounded its
    height to 0 and failed in torch)."""
    image = torch.zeros(shape[0], 1, 1, shape[3]).expand(*shape)  # a view: no memory of its size
    with pytest.raises(ValueError, match=f"more than {MAX_ASPECT} to 1.*crop it"):
        tokenizer_image(image)


def test_every_aspect_up_to_the_limit_passes_both_steps():
    for h, w in ((1, 1), (1, MAX_ASPECT), (MAX_ASPECT, 1), (37, 53), (3, 7), (1080, 1920), (100, 1599)):
        out = tokenizer_image(torch.rand(1, h, w, 3))
        assert check_tokenized(out) is out  # what the pool checks: every tokenizer output passes
        assert vision_pixels(out, 28).shape == (1, 3, 28, 28)


def test_the_model_step_image_by_image_equals_comfyuis_batch():
    import torch.nn.functional as F

    image = torch.rand(3, 40, 173, 3)
    x = F.interpolate(image.movedim(-1, 1), size=(28, round(28 / 40 * 173)), mode="bicubic", antialias=True)
    left = (x.shape[3] - 28) // 2
    want = (torch.clip(255.0 * x[..., left:left + 28], 0, 255).round() / 255.0 - 0.5) / 0.5  # clip_preprocess
    assert torch.equal(vision_pixels(image, 28), want)


def test_the_pool_refuses_an_image_the_tokenizer_did_not_resize():
    with pytest.raises(ValueError, match="2000 x 2000 pixels of 3 channels, more than ComfyUI's Gemma tokenizer.*"
                                         "tokenizer_image"):
        check_tokenized(torch.zeros(1, 2000, 2000, 3))
    # channels the tokenizer drops: a raw request's [1, 896, 896, 2000] (6.4 GB) went to every rank's check and whole
    # onto rank 0's GPU before the model's step kept three
    with pytest.raises(ValueError, match="896 x 896 pixels of 4 channels.*3 channels"):
        check_tokenized(torch.zeros(1, 1, 1, 1).expand(1, 896, 896, 4))


def test_the_finite_check_of_an_image_allocates_nothing_of_its_size():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    image = torch.rand(2, 300, 400, 3)
    with Sizes() as sizes:
        check_image(image)
    assert sizes.largest < 1000  # torch.isfinite(image).all() wrote a bool per value (3 GB for 16 x 8000 x 8000)


_FC1 = "vision_model.encoder.layers.0.mlp.fc1"


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4"])
def test_a_quantized_vision_layer_is_read_and_a_damaged_one_refused(tiny_gemma_dir, tiny_gemma_comfy_file, tmp_path,
                                                                   fmt):
    with safe_open(str(tiny_gemma_comfy_file), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(tiny_gemma_comfy_file))
    dense = tensors.pop(f"{_FC1}.weight")
    parts = quantize_layer(dense.float(), LayerQuant(fmt))
    tensors.update({f"{_FC1}.{name}": value for name, value in parts.items()})
    save_file(tensors, str(tmp_path / "q.safetensors"), metadata=meta)
    source = find_vision(tmp_path / "q.safetensors")
    want = dequantize(source.quant.of(f"{_FC1}.weight"), {n: v for n, v in parts.items() if n != "comfy_quant"},
                      torch.float32)
    got = load_vision(source, _text_config(tiny_gemma_dir)).tower.encoder.layers[0].mlp.fc1.weight
    assert torch.equal(got, want) and (got - dense.float()).abs().max() < 0.5 * dense.float().abs().max()
    scale = tensors[f"{_FC1}.weight_scale"].clone()
    scale.reshape(-1).view(torch.uint8)[: scale.element_size()] = 0xFF  # a NaN (float or e8m0)
    tensors[f"{_FC1}.weight_scale"] = scale
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(GemmaWeightsError, match=f"{_FC1}.weight holds NaN or infinite values.*download it again"):
        load_vision(find_vision(tmp_path / "bad.safetensors"), _text_config(tiny_gemma_dir))


@pytest.mark.parametrize("key", ["vision_model.encoder.layers.0.self_attn.q_proj.weight",
                                 "multi_modal_projector.mm_input_projection_weight"])
def test_a_non_finite_vision_weight_is_refused_at_load(tiny_gemma_dir, tiny_gemma_comfy_file, tmp_path, key):
    with safe_open(str(tiny_gemma_comfy_file), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(tiny_gemma_comfy_file))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = float("inf")
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(GemmaWeightsError, match=f"{key} holds NaN or infinite values; the file is damaged"):
        load_vision(find_vision(tmp_path / "bad.safetensors"), _text_config(tiny_gemma_dir))


def test_stored_position_ids_are_not_read_as_a_weight(tiny_gemma_dir, tiny_gemma_comfy_file, tmp_path):
    """An export that wrote SigLIP's ``position_ids`` buffer (int64 ``arange``): before, the image was
    refused as 'stored as I64 without a ComfyUI comfy_quant marker'."""
    with safe_open(str(tiny_gemma_comfy_file), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(tiny_gemma_comfy_file))
    tensors["vision_model.embeddings.position_ids"] = torch.arange(4)[None]
    path = tmp_path / "ids.safetensors"
    save_file(tensors, str(path), metadata=meta)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    config = _text_config(tiny_gemma_dir)
    with torch.inference_mode():
        assert torch.equal(load_vision(find_vision(path), config)(pixels),
                           load_vision(find_vision(tiny_gemma_comfy_file), config)(pixels))
