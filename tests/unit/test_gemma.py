"""Loading the Gemma 3 text tower from every supported format, and its hidden states: the same from
every layout, from the full multimodal model and when compiled.

Uses the tiny deterministic Gemma (ltx_mgpu.assets), built once per session by tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gemma_support import PROMPTS, assert_identical, hidden
from safetensors.torch import load_file, save_file

from ltx_mgpu.assets.gemma import TINY_GEMMA_HIDDEN, TINY_GEMMA_HIDDEN_STATES
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import compile_text_tower, encode_hidden_states
from ltx_mgpu.text.gemma.sources import GemmaFormatError, detect_gemma_format
from ltx_mgpu.text.gemma.tokenizer import tokenize

# --------------------------------------------------------------------------- formats


def test_detect_formats(gemma, tmp_path):
    assert detect_gemma_format(gemma["snapshot"]) == "hf_snapshot"
    assert detect_gemma_format(gemma["comfy"]) == "comfy_file"
    (tmp_path / "nf4").mkdir()
    (tmp_path / "nf4" / "ltx_mgpu_nf4.json").write_text("{}")
    assert detect_gemma_format(tmp_path / "nf4") == "nf4_artifact"
    from ltx_mgpu.text.nf4.artifact import NF4ArtifactError

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
    "case", ["random_safetensors", "pickle_file", "empty_dir", "pickle_snapshot", "other_model", "hf_shard",
             "garbage_safetensors"]
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
    assert_identical(a, b)


def test_snapshot_matches_full_multimodal_model(gemma):
    """No silent random init: the text tower equals the one inside the full official model."""
    from transformers import Gemma3ForConditionalGeneration

    full = Gemma3ForConditionalGeneration.from_pretrained(gemma["snapshot"], dtype=torch.bfloat16,
                                                          attn_implementation="sdpa")
    ids, mask, _ = tokenize(gemma["tower"], PROMPTS)
    with torch.inference_mode():
        ref = full.model.language_model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert_identical(encode_hidden_states(gemma["tower"], ids, mask), ref)


def test_hidden_state_convention(gemma):
    """Index 0 = scaled embeddings, last = final decoder layer output after the final RMSNorm."""
    model = gemma["tower"].model
    seen = {}
    handle = model.layers[-1].register_forward_hook(
        lambda m, i, o: seen.setdefault("last", o[0] if isinstance(o, tuple) else o))
    try:
        hs, mask = hidden(gemma["tower"])
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
    save_file({"model." + k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)},
              str(out / "model.safetensors"))
    tower = load_gemma_text_tower(out)
    assert detect_gemma_format(out) == "hf_snapshot" and out / "tokenizer.model" in tower.files
    assert_identical(hidden(tower)[0], hidden(gemma["tower"])[0])


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


# --------------------------------------------------------------------------- compiled towers


def test_compiled_tower_gives_the_same_states(gemma):
    compiled = compile_text_tower(gemma["tower"], backend="eager")
    assert compiled.model is not gemma["tower"].model and compiled.config is gemma["tower"].config
    assert_identical(hidden(compiled, PROMPTS[:2])[0], hidden(gemma["tower"], PROMPTS[:2])[0])


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
    assert_identical(hidden(compiled, PROMPTS[:2])[0], hidden(tower, PROMPTS[:2])[0])
    if scope == "layers":  # one graph per attention type, no graph break inside a layer
        assert 0 < len(graphs) <= len(set(tower.config.layer_types)), len(graphs)
    else:
        assert len(graphs) == 1
    n = len(graphs)
    hidden(tower, PROMPTS[:2])  # the original tower stays uncompiled
    assert len(graphs) == n
    with pytest.raises(ValueError, match="scope must be 'model'.* or 'layers'"):
        compile_text_tower(tower, "decoder")
