"""Loading the Gemma 3 text tower from every supported format, and tokenizing like ComfyUI.

Uses the tiny deterministic Gemma (ltx_mgpu.assets), built once per session by tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.assets import TINY_GEMMA_HIDDEN, TINY_GEMMA_HIDDEN_STATES
from ltx_mgpu.assets.gemma import BOS_ID, EOS_ID, PAD_ID, build_tiny_gemma_comfy_file
from ltx_mgpu.text.gemma import compile_text_tower, encode_hidden_states, load_gemma_text_tower
from ltx_mgpu.text.gemma_sources import (
    GemmaFormatError,
    GemmaWeightsError,
    detect_gemma_format,
    gemma3_text_config,
    gemma_identity,
)
from ltx_mgpu.text.tokenizer import PromptTooLongError, tokenize

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, "日本 x\ty\n  é", ""]  # 2..~90 tokens: sliding window 16 exercised


@pytest.fixture(scope="session")
def gemma(tiny_gemma_dir, tiny_gemma_comfy_file):
    """The tiny Gemma (conftest builds it once per session) and its snapshot-loaded tower."""
    return {"snapshot": tiny_gemma_dir, "comfy": tiny_gemma_comfy_file, "tower": load_gemma_text_tower(tiny_gemma_dir)}


def _hidden(tower, prompts=PROMPTS):
    ids, mask, _ = tokenize(tower, prompts)
    return encode_hidden_states(tower, ids, mask), mask


def _assert_identical(a, b):
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), [float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)]


def _token_cosine(a, b, mask):
    m = mask.bool()
    return [torch.nn.functional.cosine_similarity(x[m].float(), y[m].float(), dim=-1) for x, y in zip(a, b)]


# --------------------------------------------------------------------------- formats


def test_detect_formats(gemma, tmp_path):
    assert detect_gemma_format(gemma["snapshot"]) == "hf_snapshot"
    assert detect_gemma_format(gemma["comfy"]) == "comfy_file"
    (tmp_path / "nf4").mkdir()
    (tmp_path / "nf4" / "ltx_mgpu_nf4.json").write_text("{}")
    assert detect_gemma_format(tmp_path / "nf4") == "nf4_artifact"
    from ltx_mgpu.text.nf4_artifact import NF4ArtifactError

    with pytest.raises(NF4ArtifactError, match="not an ltx_mgpu NF4 manifest"):
        load_gemma_text_tower(tmp_path / "nf4")
    assert load_gemma_text_tower(gemma["snapshot"], weights="nf4").weights == "nf4"
    with pytest.raises(ValueError, match="'bf16' or 'nf4'"):
        load_gemma_text_tower(gemma["snapshot"], weights="int4")
    with pytest.raises(FileNotFoundError):
        detect_gemma_format(tmp_path / "absent")


def _unsupported(tmp_path: Path, gemma) -> dict[str, Path]:
    cases = {}
    cases["random_safetensors"] = tmp_path / "random.safetensors"
    save_file({"foo.weight": torch.zeros(2, 2)}, str(cases["random_safetensors"]))
    cases["pickle_file"] = tmp_path / "gemma.bin"
    cases["pickle_file"].write_bytes(b"\x80\x04not loaded")
    cases["empty_dir"] = tmp_path / "empty"
    cases["empty_dir"].mkdir()
    cases["pickle_snapshot"] = tmp_path / "binsnap"
    cases["pickle_snapshot"].mkdir()
    shutil.copy(gemma["snapshot"] / "config.json", cases["pickle_snapshot"])
    (cases["pickle_snapshot"] / "pytorch_model.bin").write_bytes(b"\x80\x04")
    cases["other_model"] = tmp_path / "llama"
    shutil.copytree(gemma["snapshot"], cases["other_model"])
    cfg = json.loads((cases["other_model"] / "config.json").read_text())
    (cases["other_model"] / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    cases["hf_shard"] = gemma["snapshot"] / "model.safetensors"
    cases["garbage_safetensors"] = tmp_path / "garbage.safetensors"
    cases["garbage_safetensors"].write_bytes(b"\xff" * 64)
    return cases


@pytest.mark.parametrize(
    "case", ["random_safetensors", "pickle_file", "empty_dir", "pickle_snapshot", "other_model", "hf_shard", "garbage_safetensors"]
)
def test_unsupported_sources_name_the_supported_formats(gemma, tmp_path, case):
    path = _unsupported(tmp_path, gemma)[case]
    for fn in (detect_gemma_format, load_gemma_text_tower):
        with pytest.raises(GemmaFormatError) as err:
            fn(path)
        msg = str(err.value)
        assert "Hugging Face snapshot directory" in msg and "ComfyUI single-file" in msg and "NF4 artifact" in msg
        assert str(path) in msg


# --------------------------------------------------------------------------- parity


def test_snapshot_and_comfy_file_are_bit_identical(gemma):
    tower, comfy = gemma["tower"], load_gemma_text_tower(gemma["comfy"])
    assert (tower.format, comfy.format) == ("hf_snapshot", "comfy_file")
    assert tower.config.to_dict() == comfy.config.to_dict()
    ids_a, mask_a, _ = tokenize(tower, PROMPTS)
    ids_b, mask_b, _ = tokenize(comfy, PROMPTS)
    assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b)
    assert mask_a.sum(1).max() > 2 * tower.config.sliding_window and (mask_a == 0).any()
    a, b = encode_hidden_states(tower, ids_a, mask_a), encode_hidden_states(comfy, ids_b, mask_b)
    assert len(a) == TINY_GEMMA_HIDDEN_STATES == tower.num_hidden_states
    assert a[0].shape == (len(PROMPTS), ids_a.shape[1], TINY_GEMMA_HIDDEN) and a[0].dtype == torch.bfloat16
    assert all(torch.isfinite(h).all() for h in a)  # pad rows too: no NaN leaks into masked statistics
    _assert_identical(a, b)


def test_snapshot_matches_full_multimodal_model(gemma):
    """No silent random init: the text tower equals the one inside the full official model."""
    from transformers import Gemma3ForConditionalGeneration

    full = Gemma3ForConditionalGeneration.from_pretrained(gemma["snapshot"], dtype=torch.bfloat16, attn_implementation="sdpa")
    ids, mask, _ = tokenize(gemma["tower"], PROMPTS)
    with torch.inference_mode():
        ref = full.model.language_model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    _assert_identical(encode_hidden_states(gemma["tower"], ids, mask), ref)


def test_hidden_state_convention(gemma):
    """Index 0 = scaled embeddings, last = final decoder layer output after the final RMSNorm."""
    model = gemma["tower"].model
    seen = {}
    handle = model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("last", o[0] if isinstance(o, tuple) else o))
    try:
        hs, mask = _hidden(gemma["tower"])
    finally:
        handle.remove()
    ids = tokenize(gemma["tower"], PROMPTS)[0]
    with torch.inference_mode():
        assert torch.equal(hs[0], model.embed_tokens(ids))
        assert torch.equal(hs[-1], model.norm(seen["last"]))


def test_text_only_snapshot_layout(gemma, tmp_path):
    """A Gemma3ForCausalLM-style snapshot (model.* keys, gemma3_text config) loads identically."""
    src = gemma["snapshot"]
    out = tmp_path / "text_only"
    out.mkdir()
    shutil.copy(src / "tokenizer.model", out)  # SentencePiece only: converted by transformers' GemmaConverter
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["Gemma3ForCausalLM"]}))
    sd = load_file(str(src / "model.safetensors"))
    prefix = "language_model.model."
    save_file({"model." + k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}, str(out / "model.safetensors"))
    tower = load_gemma_text_tower(out)
    assert detect_gemma_format(out) == "hf_snapshot" and out / "tokenizer.model" in tower.files
    _assert_identical(_hidden(tower)[0], _hidden(gemma["tower"])[0])


def test_vision_tower_is_not_loaded(gemma):
    for tower in (gemma["tower"], load_gemma_text_tower(gemma["comfy"])):
        c = tower.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        per_layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
        per_layer += 2 * c.head_dim + 4 * c.hidden_size  # q/k norms, 4 layer norms
        expected = c.vocab_size * c.hidden_size + c.num_hidden_layers * per_layer + c.hidden_size
        assert sum(p.numel() for p in tower.model.parameters()) == expected
        names = [n for n, _ in tower.model.named_modules()]
        assert not any(w in n for n in names for w in ("vision", "multi_modal", "lm_head"))
        assert type(tower.model).__name__ == "Gemma3TextModel" and not tower.model.training
        # weights in bf16, RoPE inverse frequencies computed in fp32
        assert {p.dtype for p in tower.model.parameters()} == {torch.bfloat16}
        assert all(b.dtype == torch.float32 for n, b in tower.model.named_buffers() if "inv_freq" in n)


# --------------------------------------------------------------------------- broken weights


def test_snapshot_missing_tensor_is_named(gemma, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(gemma["snapshot"], broken)
    sd = load_file(str(broken / "model.safetensors"))
    del sd["language_model.model.layers.3.mlp.down_proj.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(GemmaWeightsError, match=r"missing text-tower weight\(s\): \['layers\.3\.mlp\.down_proj\.weight'\]"):
        load_gemma_text_tower(broken)


def _rewrite_comfy(src: Path, dst: Path, drop=(), rename=None, metadata=None):
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        meta = dict(f.metadata())
    if rename:
        tensors = {rename(k): v for k, v in tensors.items()}
    save_file(tensors, str(dst), metadata=meta if metadata is None else metadata)
    return dst


def test_comfy_missing_tensor_and_config_mismatch(gemma, tmp_path):
    with pytest.raises(GemmaWeightsError, match=r"layers\.0\.self_attn\.k_norm\.weight"):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "m.safetensors", drop={"model.layers.0.self_attn.k_norm.weight"}))
    with safe_open(str(gemma["comfy"]), "pt") as f:
        meta = dict(f.metadata())
    cfg = json.loads(meta["ltx_mgpu_gemma_config"])
    meta["ltx_mgpu_gemma_config"] = json.dumps({**cfg, "intermediate_size": 96})
    with pytest.raises(GemmaWeightsError, match=r"shape not matching the config.*mlp\.down_proj"):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "s.safetensors", metadata=meta))
    meta["ltx_mgpu_gemma_config"] = json.dumps({**cfg, "num_hidden_layers": 5, "layer_types": cfg["layer_types"][:5]})
    with pytest.raises(GemmaWeightsError, match=r"no place for.*layers\.5\."):
        load_gemma_text_tower(_rewrite_comfy(gemma["comfy"], tmp_path / "l.safetensors", metadata=meta))


def test_comfy_without_metadata_infers_config(gemma, tmp_path):
    path = _rewrite_comfy(gemma["comfy"], tmp_path / "nometa.safetensors", metadata={"format": "pt"})
    tower = load_gemma_text_tower(path)
    ref = gemma["tower"].config
    inferred = tower.config
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "layer_types", "rope_parameters", "rms_norm_eps")
    assert {k: getattr(inferred, k) for k in same} == {k: getattr(ref, k) for k in same}
    assert inferred.sliding_window == 1024  # Gemma 3 12B's default: differs from the tiny model's 16
    short = ["the cat walks", "a dog"]  # <= 16 tokens: the sliding window does not bite
    _assert_identical(_hidden(tower, short)[0], _hidden(gemma["tower"], short)[0])


# --------------------------------------------------------------------------- fp16 / fp8 files


def test_fp16_and_fp8_comfy_files_are_close_to_bf16(gemma, tmp_path):
    """Tolerances (tiny random model, bf16 compute): fp16 storage of bf16 weights is lossless
    except for fp16-subnormal values, so hidden states match to bf16 rounding (measured per-token
    cosine 1.0000; asserted >= 0.999); fp8 e4m3 keeps 3 mantissa bits (<= 6.25% weight error):
    measured per-token cosine >= 0.977 (worst token, final state) and mean >= 0.993 per hidden
    state; asserted >= 0.97 and >= 0.99."""
    base, mask = _hidden(gemma["tower"])
    fp16 = tmp_path / "fp16.safetensors"
    build_tiny_gemma_comfy_file(gemma["snapshot"], fp16, "fp16")
    fp8 = tmp_path / "fp8.safetensors"
    build_tiny_gemma_comfy_file(gemma["snapshot"], fp8, "fp8_e4m3fn_scaled")
    t16, t8 = load_gemma_text_tower(fp16), load_gemma_text_tower(fp8)
    assert {p.dtype for p in t8.model.parameters()} == {torch.bfloat16}
    h16, h8 = _hidden(t16)[0], _hidden(t8)[0]
    assert all(float(c.min()) >= 0.999 for c in _token_cosine(base, h16, mask))
    cos8 = _token_cosine(base, h8, mask)
    assert all(float(c.min()) >= 0.97 and float(c.mean()) >= 0.99 for c in cos8), [float(c.min()) for c in cos8]
    assert not all(torch.equal(x, y) for x, y in zip(base, h8))  # fp8 really was dequantised, not bypassed
    # the older ComfyUI scaled-fp8 naming (<layer>.scale_weight) dequantises the same way
    legacy = _rewrite_comfy(fp8, tmp_path / "legacy.safetensors", rename=lambda k: k.replace(".weight_scale", ".scale_weight"))
    _assert_identical(_hidden(load_gemma_text_tower(legacy))[0], h8)


def test_unsupported_quantized_comfy_weights(gemma, tmp_path):
    path = tmp_path / "q.safetensors"
    with safe_open(str(gemma["comfy"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 32, dtype=torch.uint8)  # packed 4-bit
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(GemmaFormatError, match=r"up_proj\.weight is stored as U8.*bf16, fp16 or fp8"):
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
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (3840, 48, 16, 8)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.vocab_size) == (256, 256, 1024, 262208)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41, 47]
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_compiled_tower_gives_the_same_states(gemma):
    compiled = compile_text_tower(gemma["tower"], backend="eager")
    assert compiled.model is not gemma["tower"].model and compiled.config is gemma["tower"].config
    _assert_identical(_hidden(compiled, PROMPTS[:2])[0], _hidden(gemma["tower"], PROMPTS[:2])[0])


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compile_scopes_share_weights_and_graphs(gemma, scope):
    """Regional compilation reuses one set of graphs for every layer; whole-model compilation
    makes one graph. The backend records each graph Dynamo hands it and runs it as traced."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    tower = gemma["tower"]
    whole = {"fullgraph": True} if scope == "model" else {}  # the whole model compiles without a graph break
    compiled = compile_text_tower(tower, scope, backend=recording_backend, **whole)
    shared = dict(tower.model.named_parameters())
    assert all(p is shared[n] for n, p in compiled.model.named_parameters()) and len(shared) > 0
    assert type(compiled.model) is type(tower.model)
    _assert_identical(_hidden(compiled, PROMPTS[:2])[0], _hidden(tower, PROMPTS[:2])[0])
    if scope == "layers":  # one graph per attention type, no graph break inside a layer
        assert 0 < len(graphs) <= len(set(tower.config.layer_types)), len(graphs)
    else:
        assert len(graphs) == 1
    n = len(graphs)
    _hidden(tower, PROMPTS[:2])  # the original tower stays uncompiled
    assert len(graphs) == n
    with pytest.raises(ValueError, match="scope must be 'model'.* or 'layers'"):
        compile_text_tower(tower, "decoder")


def test_comfy_file_with_a_broken_embedded_tokenizer_is_named(gemma, tmp_path):
    path = tmp_path / "badtok.safetensors"
    with safe_open(str(gemma["comfy"]), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    tensors["spiece_model"] = torch.frombuffer(bytearray(b"\xff" * 64), dtype=torch.uint8)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(GemmaFormatError, match=r"badtok\.safetensors: embedded 'spiece_model': not a SentencePiece"):
        load_gemma_text_tower(path)


# --------------------------------------------------------------------------- tokenize / encode


def test_tokenize_bos_no_eos_left_padding(gemma):
    tower = gemma["tower"]
    ids, mask, dropped = tokenize(tower, ["the cat walks slowly", "x", ""])
    assert ids.dtype == mask.dtype == torch.long and dropped == [0, 0, 0]
    lengths = mask.sum(1).tolist()
    assert lengths[1] == 2 and lengths[2] == 1 and ids.shape[1] == lengths[0]  # padded to the longest, not 1024
    for row, n in zip(range(3), lengths):
        assert mask[row, : ids.shape[1] - n].eq(0).all() and mask[row, ids.shape[1] - n :].eq(1).all()
        assert ids[row, : ids.shape[1] - n].eq(PAD_ID).all()
        assert ids[row, ids.shape[1] - n] == BOS_ID and EOS_ID not in ids[row].tolist()
    assert ids[0].tolist() == tower.tokenizer("the cat walks slowly")["input_ids"]
    # ComfyUI's escape_important/unescape_important round trip drops the backslash of \( and \)
    assert torch.equal(tokenize(tower, ["a \\(red\\) cat"])[0], tokenize(tower, ["a (red) cat"])[0])


def test_tokenize_truncation_and_budget_error(gemma):
    tower = gemma["tower"]
    n = len(tower.tokenizer(LONG)["input_ids"])
    ids, mask, dropped = tokenize(tower, ["the cat", LONG], max_length=10)
    assert ids.shape == (2, 10) and dropped == [0, n - 10]
    assert ids[1].tolist() == tower.tokenizer(LONG)["input_ids"][:10]  # the first tokens, BOS included
    with pytest.raises(PromptTooLongError, match=rf"prompt 1 has {n} tokens .* budget of 10"):
        tokenize(tower, ["the cat", LONG], max_length=10, truncate=False)
    for bad in ([], "a prompt", ["ok", None]):
        with pytest.raises(ValueError):
            tokenize(tower, bad)


def test_left_padding_keeps_valid_states_up_to_rounding(gemma):
    """Position ids are arange over the padded length (as in ComfyUI), so padding shifts the RoPE
    positions of the real tokens; RoPE is relative, so in fp32 the real tokens' hidden states
    are unchanged to ~1e-6 (bf16: a few bf16 ulps of rounding, documented in tokenize())."""
    tower = load_gemma_text_tower(gemma["comfy"], dtype=torch.float32)
    alone_ids, alone_mask, _ = tokenize(tower, ["the cat walks"])
    batch_ids, batch_mask, _ = tokenize(tower, [LONG + LONG, "the cat walks"])
    n = alone_ids.shape[1]
    assert batch_ids.shape[1] > 3 * n
    alone = encode_hidden_states(tower, alone_ids, alone_mask)
    batch = encode_hidden_states(tower, batch_ids, batch_mask)
    for a, b in zip(alone, batch):
        torch.testing.assert_close(b[1, -n:], a[0], atol=1e-4, rtol=1e-4)


def test_encode_rejects_bad_shapes(gemma):
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        encode_hidden_states(gemma["tower"], torch.ones(4, dtype=torch.long), torch.ones(4, dtype=torch.long))
