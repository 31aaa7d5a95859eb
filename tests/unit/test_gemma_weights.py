"""Gemma weights that are broken or not bf16, and what a tower is made of: missing or mismatched
tensors are named, fp16 and fp8 ComfyUI files come close to bf16, tokenizer sources beside a ComfyUI
file, the content identity and the Gemma 3 12B default config.

Uses the tiny deterministic Gemma (ltx_mgpu.assets), built once per session by tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gemma_support import PROMPTS, assert_identical, hidden
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.assets.gemma import build_tiny_gemma_comfy_file
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.sources import GemmaFormatError, GemmaWeightsError, gemma3_text_config, gemma_identity
from ltx_mgpu.text.gemma.tokenizer import tokenize


def _token_cosine(a, b, mask):
    m = mask.bool()
    return [torch.nn.functional.cosine_similarity(x[m].float(), y[m].float(), dim=-1) for x, y in zip(a, b)]


# --------------------------------------------------------------------------- broken weights


def test_snapshot_missing_tensor_is_named(gemma, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(gemma["snapshot"], broken)
    sd = load_file(str(broken / "model.safetensors"))
    del sd["language_model.model.layers.3.mlp.down_proj.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(GemmaWeightsError,
                       match=r"missing text-tower weight\(s\): \['layers\.3\.mlp\.down_proj\.weight'\]"):
        load_gemma_text_tower(broken)


def _rewrite_comfy(src: Path, dst: Path, drop=(), rename=None, metadata=None):
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}  # noqa: SIM118 - safe_open is not iterable
        meta = dict(f.metadata())
    if rename:
        tensors = {rename(k): v for k, v in tensors.items()}
    save_file(tensors, str(dst), metadata=meta if metadata is None else metadata)
    return dst


def test_comfy_missing_tensor_and_config_mismatch(gemma, tmp_path):
    with pytest.raises(GemmaWeightsError, match=r"layers\.0\.self_attn\.k_norm\.weight"):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "m.safetensors",
                                             drop={"model.layers.0.self_attn.k_norm.weight"}))
    with safe_open(str(gemma["comfy"]), "pt") as f:
        meta = dict(f.metadata())
    cfg = json.loads(meta["ltx_mgpu_gemma_config"])
    meta["ltx_mgpu_gemma_config"] = json.dumps({**cfg, "intermediate_size": 96})
    # a stored config that contradicts the weights is refused from the header, naming the field
    with pytest.raises(GemmaWeightsError, match=r"metadata says intermediate_size 96, the weights \d+"):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "s.safetensors", metadata=meta))
    meta["ltx_mgpu_gemma_config"] = json.dumps({**cfg, "num_hidden_layers": 5, "layer_types": cfg["layer_types"][:5]})
    with pytest.raises(GemmaWeightsError, match=r"metadata says num_hidden_layers 5, the weights \d+"):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "l.safetensors", metadata=meta))


def test_comfy_without_metadata_infers_config(gemma, tmp_path):
    path = _rewrite_comfy(gemma["comfy"], tmp_path / "nometa.safetensors", metadata={"format": "pt"})
    tower = load_gemma_text_tower(path)
    ref = gemma["tower"].config
    inferred = tower.config
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "layer_types", "rope_parameters",
            "rms_norm_eps")
    assert {k: getattr(inferred, k) for k in same} == {k: getattr(ref, k) for k in same}
    assert inferred.sliding_window == 1024  # Gemma 3 12B's default: differs from the tiny model's 16
    short = ["the cat walks", "a dog"]  # <= 16 tokens: the sliding window does not bite
    assert_identical(hidden(tower, short)[0], hidden(gemma["tower"], short)[0])


# --------------------------------------------------------------------------- fp16 / fp8 files


def test_fp16_and_fp8_comfy_files_are_close_to_bf16(gemma, tmp_path):
    """Tolerances (tiny random model, bf16 compute): fp16 storage of bf16 weights is lossless
    except for fp16-subnormal values, so hidden states match to bf16 rounding (measured per-token
    cosine 1.0000; asserted >= 0.999); fp8 e4m3 keeps 3 mantissa bits (<= 6.25% weight error):
    measured per-token cosine >= 0.977 (worst token, final state) and mean >= 0.993 per hidden
    state; asserted >= 0.97 and >= 0.99."""
    base, mask = hidden(gemma["tower"])
    fp16 = tmp_path / "fp16.safetensors"
    build_tiny_gemma_comfy_file(gemma["snapshot"], fp16, "fp16")
    fp8 = tmp_path / "fp8.safetensors"
    build_tiny_gemma_comfy_file(gemma["snapshot"], fp8, "fp8_e4m3fn_scaled")
    t16, t8 = load_gemma_text_tower(fp16), load_gemma_text_tower(fp8)
    assert {p.dtype for p in t8.model.parameters()} == {torch.bfloat16}
    h16, h8 = hidden(t16)[0], hidden(t8)[0]
    assert all(float(c.min()) >= 0.999 for c in _token_cosine(base, h16, mask))
    cos8 = _token_cosine(base, h8, mask)
    assert all(float(c.min()) >= 0.97 and float(c.mean()) >= 0.99 for c in cos8), [float(c.min()) for c in cos8]
    assert not all(torch.equal(x, y) for x, y in zip(base, h8))  # fp8 really was dequantised, not bypassed
    # the older ComfyUI scaled-fp8 naming (<layer>.scale_weight) dequantises the same way
    legacy = _rewrite_comfy(fp8, tmp_path / "legacy.safetensors",
                            rename=lambda k: k.replace(".weight_scale", ".scale_weight"))
    assert_identical(hidden(load_gemma_text_tower(legacy))[0], h8)


def test_unsupported_quantized_comfy_weights(gemma, tmp_path):
    path = tmp_path / "q.safetensors"
    with safe_open(str(gemma["comfy"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
        meta = dict(f.metadata())
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 32, dtype=torch.uint8)  # packed 4-bit
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(GemmaFormatError, match=r"up_proj\.weight is stored as U8 without a ComfyUI comfy_quant "
                                               r"marker.*bf16, fp16 and fp32.*nvfp4"):
        load_gemma_text_tower(path)


# --------------------------------------------------------------------------- tokenizer sources, identity


def test_comfy_tokenizer_beside_file(gemma, tmp_path):
    d = tmp_path / "te"
    d.mkdir()
    path = _rewrite_comfy(gemma["comfy"], d / "gemma.safetensors", drop={"spiece_model"})
    with pytest.raises(GemmaFormatError, match="no tokenizer"):
        load_gemma_text_tower(path)
    expected = tokenize(gemma["tower"], PROMPTS)[0]
    shutil.copy(gemma["snapshot"] / "tokenizer.json", d)  # beside the file, without tokenizer_config.json
    tower = load_gemma_text_tower(path)
    assert torch.equal(tokenize(tower, PROMPTS)[0], expected) and tower.files == (path, d / "tokenizer.json")
    (d / "gemma").mkdir()  # a directory named like the file wins
    shutil.copy(gemma["snapshot"] / "tokenizer.model", d / "gemma")
    tower = load_gemma_text_tower(path)
    assert torch.equal(tokenize(tower, PROMPTS)[0], expected)
    assert tower.files == (path, d / "gemma" / "tokenizer.model")
    assert gemma_identity(path) == tower.identity


def test_identity_is_content_based(gemma, tmp_path):
    tower = gemma["tower"]
    assert len(tower.identity) == 64 and tower.identity == tower.identity
    copy = tmp_path / "copy"
    shutil.copytree(gemma["snapshot"], copy)
    assert load_gemma_text_tower(copy).identity == tower.identity  # same bytes, other path
    sd = load_file(str(copy / "model.safetensors"))
    sd["language_model.model.norm.weight"] = sd["language_model.model.norm.weight"] + 1
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert load_gemma_text_tower(copy).identity != tower.identity
    comfy = load_gemma_text_tower(gemma["comfy"])
    assert comfy.identity != tower.identity and comfy.files == (gemma["comfy"],)
    renamed = tmp_path / "gemma_3_12B_it_renamed.safetensors"
    shutil.copy(gemma["comfy"], renamed)
    assert load_gemma_text_tower(renamed).identity == comfy.identity
    # computable without loading Gemma (the cache key is built before any load)
    assert gemma_identity(gemma["snapshot"]) == tower.identity and gemma_identity(gemma["comfy"]) == comfy.identity


def test_gemma3_12b_default_config():
    cfg = gemma3_text_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (3840, 48, 16, 8)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.vocab_size) == (256, 256, 1024, 262208)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41, 47]
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_comfy_file_with_a_broken_embedded_tokenizer_is_named(gemma, tmp_path):
    path = tmp_path / "badtok.safetensors"
    with safe_open(str(gemma["comfy"]), "pt") as f:
        tensors, meta = ({k: f.get_tensor(k) for k in f.keys()},  # noqa: SIM118 - safe_open is not iterable
                         dict(f.metadata()))
    tensors["spiece_model"] = torch.frombuffer(bytearray(b"\xff" * 64), dtype=torch.uint8)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(GemmaFormatError, match=r"badtok\.safetensors: embedded 'spiece_model': not a SentencePiece"):
        load_gemma_text_tower(path)
