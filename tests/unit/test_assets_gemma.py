"""The tiny deterministic Gemma 3 assets: determinism, layouts, and a tokenizer that is really
SentencePiece (HF conversion == SentencePiece, token for token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ltx_mgpu.assets.gemma import (
    BOS_ID,
    BYTE_PIECES_START,
    END_OF_TURN_ID,
    EOS_ID,
    IMAGE_TOKEN_ID,
    PAD_ID,
    SPECIAL_PIECES,
    START_OF_TURN_ID,
    TINY_GEMMA_HIDDEN,
    TINY_GEMMA_LAYERS,
    TINY_GEMMA_VOCAB,
    UNK_ID,
    build_tiny_gemma_comfy_file,
    build_tiny_gemma_snapshot,
    tiny_spm_pieces,
)
from ltx_mgpu.text.gemma.tokenizer import tokenizer_from_spm


@pytest.fixture(scope="session")
def assets(tiny_gemma_dir, tiny_gemma_comfy_file):
    """The tiny Gemma as built through ltx_mgpu.assets (conftest: once per session, tmp dir)."""
    return {"snapshot": tiny_gemma_dir, "comfy": tiny_gemma_comfy_file}


@pytest.fixture(scope="session")
def sp(assets):
    sentencepiece = pytest.importorskip("sentencepiece")
    return sentencepiece.SentencePieceProcessor(model_file=str(assets["snapshot"] / "tokenizer.model"), add_bos=True)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files(tmp_path, assets):
    for run in ("a", "b"):
        build_tiny_gemma_snapshot(tmp_path / run / "snap", seed=0)
        for fmt in ("bf16", "fp16", "fp8_e4m3fn_scaled"):
            build_tiny_gemma_comfy_file(tmp_path / run / "snap", tmp_path / run / f"comfy-{fmt}.safetensors", fmt)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert sorted(a) == sorted(b) and len(a) == 6 + 3
    assert all(a[name] == b[name] for name in a), [name for name in a if a[name] != b[name]]
    # the cached assets (built via ltx_mgpu.assets) are the same bytes too
    assert _files(assets["snapshot"]) == {k[len("snap/") :]: v for k, v in a.items() if k.startswith("snap/")}
    assert assets["comfy"].read_bytes() == a["comfy-bf16.safetensors"]


def test_other_seed_gives_other_weights(tmp_path, assets):
    build_tiny_gemma_snapshot(tmp_path / "s1", seed=1)
    assert ((tmp_path / "s1" / "model.safetensors").read_bytes()
            != (assets["snapshot"] / "model.safetensors").read_bytes())
    assert (tmp_path / "s1" / "tokenizer.model").read_bytes() == (assets["snapshot"] / "tokenizer.model").read_bytes()


def test_snapshot_is_a_real_multimodal_gemma3(assets):
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForConditionalGeneration

    snap = assets["snapshot"]
    assert sorted(p.name for p in snap.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json",
    ]
    cfg = AutoConfig.from_pretrained(snap)
    text = cfg.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (TINY_GEMMA_HIDDEN, TINY_GEMMA_LAYERS,
                                                                            TINY_GEMMA_VOCAB)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim,
            text.query_pre_attn_scalar) == (4, 2, 16, 16)
    assert text.sliding_window == 16 and text.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert text.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert text.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert (cfg.image_token_index, cfg.mm_tokens_per_image) == (IMAGE_TOKEN_ID, 4)
    with safe_open(str(snap / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert "language_model.model.layers.5.self_attn.q_norm.weight" in keys
    model = Gemma3ForConditionalGeneration.from_pretrained(snap, dtype=torch.bfloat16)
    assert model.model.vision_tower is not None
    tok = AutoTokenizer.from_pretrained(snap)  # offline, from tokenizer.json
    assert tok.padding_side == "left"
    assert tok("the cat")["input_ids"][0] == BOS_ID and tok("the cat")["input_ids"][-1] != EOS_ID
    assert tok.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]) == [
        PAD_ID, EOS_ID, BOS_ID, UNK_ID, START_OF_TURN_ID, END_OF_TURN_ID,
    ]
    assert len(tok) == TINY_GEMMA_VOCAB


def test_sentencepiece_model_has_gemma_ids(sp):
    assert sp.get_piece_size() == TINY_GEMMA_VOCAB
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    for i, piece in SPECIAL_PIECES.items():
        assert sp.id_to_piece(i) == piece and (sp.is_control(i) or sp.is_unknown(i))
    assert all(sp.is_byte(BYTE_PIECES_START + b) for b in range(256))
    # every multi-character normal piece has exactly one split: merges are unambiguous
    normal = {p for p, _, t in tiny_spm_pieces() if t == 1}
    for piece in normal:
        if len(piece) > 1:
            assert sum(piece[:i] in normal and piece[i:] in normal for i in range(1, len(piece))) == 1, piece
    assert sp.encode("日") == [BOS_ID] + [BYTE_PIECES_START + b for b in "日".encode()]  # byte fallback


_WORDS = ["the", " the", " cat", "walks", " slowly", "  ", " ", "\n", "\t", "é", "日本", "ing", "thei", " a", "x"]
_texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.lists(st.sampled_from(_WORDS), max_size=12).map("".join),
)


@pytest.mark.parametrize("source", ["snapshot_tokenizer_json", "embedded_spiece_model"])
def test_hf_tokenizer_matches_sentencepiece(assets, sp, source):
    """Arbitrary text: HF ids == SentencePiece ids (BOS prepended, no EOS).

    Texts containing a special-token string (e.g. "<bos>") are excluded: SentencePiece reads them
    as plain characters, while HF (like ComfyUI's own special-token handling) emits the token.
    """
    if source == "snapshot_tokenizer_json":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(assets["snapshot"])
    else:
        with safe_open(str(assets["comfy"]), "pt") as f:
            tok = tokenizer_from_spm(f.get_tensor("spiece_model").numpy().tobytes())

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_texts)
    def check(text):
        assume(not any(p in text for p in SPECIAL_PIECES.values()))
        assert tok(text)["input_ids"] == sp.encode(text)

    check()


def test_tokenizer_from_spm_refuses_models_that_are_not_gemma(assets):
    """transformers' GemmaConverter hard-codes Gemma's ids and normaliser: other models are refused."""
    from sentencepiece import sentencepiece_model_pb2

    from ltx_mgpu.text.gemma.sources import GemmaFormatError

    data = (assets["snapshot"] / "tokenizer.model").read_bytes()
    with pytest.raises(GemmaFormatError, match="not a SentencePiece model"):
        tokenizer_from_spm(b"\xff" * 64)
    for change in ("ids", "dummy_prefix", "unigram"):
        proto = sentencepiece_model_pb2.ModelProto.FromString(data)
        if change == "ids":  # Llama-style ids: <unk> 0, <s> 1, </s> 2
            proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
        elif change == "dummy_prefix":
            proto.normalizer_spec.add_dummy_prefix = True
        else:
            proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.UNIGRAM
        with pytest.raises(GemmaFormatError, match="not a Gemma tokenizer"):
            tokenizer_from_spm(proto.SerializeToString())


def test_comfy_file_layout(assets):
    snap, comfy = assets["snapshot"], assets["comfy"]
    with safe_open(str(comfy), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        spm = f.get_tensor("spiece_model")
        emb = f.get_tensor("model.embed_tokens.weight")
    with safe_open(str(snap / "model.safetensors"), "pt") as f:
        assert torch.equal(emb, f.get_tensor("language_model.model.embed_tokens.weight"))
        n_hf = len(list(f.keys()))
    assert spm.dtype == torch.uint8 and spm.numpy().tobytes() == (snap / "tokenizer.model").read_bytes()
    assert {"model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.post_feedforward_layernorm.weight"} <= keys
    assert {f"model.layers.{TINY_GEMMA_LAYERS - 1}.mlp.down_proj.weight"} <= keys
    assert any(k.startswith("vision_model.encoder.layers.0.") for k in keys)
    assert "multi_modal_projector.mm_input_projection_weight" in keys
    assert not any("lm_head" in k or k.startswith(("language_model.", "vision_tower.")) for k in keys)
    assert len(keys) == n_hf + 1  # every snapshot tensor, renamed, plus spiece_model
    cfg = json.loads((snap / "config.json").read_text())
    assert json.loads(meta["ltx_mgpu_gemma_config"]) == cfg["text_config"]


def test_comfy_fp8_file_is_scaled_e4m3(tmp_path, assets):
    out = tmp_path / "fp8.safetensors"
    build_tiny_gemma_comfy_file(assets["snapshot"], out, "fp8_e4m3fn_scaled")
    with safe_open(str(out), "pt") as f, safe_open(str(assets["comfy"]), "pt") as ref:
        w = f.get_tensor("model.layers.2.mlp.up_proj.weight")
        scale = f.get_tensor("model.layers.2.mlp.up_proj.weight_scale")
        assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.ndim == 0
        assert f.get_tensor("model.layers.2.input_layernorm.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        w_ref = ref.get_tensor("model.layers.2.mlp.up_proj.weight").float()
        assert float(w.float().abs().max()) == 448.0
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
        err = (w.float() * scale - w_ref).abs()
        assert bool((err <= w_ref.abs() * 2**-4 + scale * 2**-9).all())
        layers = json.loads(f.metadata()["_quantization_metadata"])["layers"]
        assert (layers["model.layers.2.mlp.up_proj"] == {"format": "float8_e4m3fn"}
                and len(layers) == 7 * TINY_GEMMA_LAYERS)


def test_the_embedded_default_with_the_2_0_layout_takes_the_tiny_gemma():
    """``auto`` picks the real 270M only for the 2.3 layout it pairs with (found by a newcomer:
    ``encode --embedded-version 2.0`` silently gave 2.3 embeddings); asking for both is refused."""
    from ltx_mgpu.assets import embedded_default, tiny_ltx_checkpoint

    ckpt, _, label = embedded_default("auto", "2.0")
    assert label == "a tiny random Gemma 3" and ckpt == str(tiny_ltx_checkpoint("2.0"))
    with pytest.raises(ValueError, match="use --embedded-gemma tiny for the LTX-2.0 layout"):
        embedded_default("gemma-270m", "2.0")
