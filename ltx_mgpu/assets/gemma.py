"""Builders of the tiny, deterministic Gemma 3 test models (HF snapshot and ComfyUI single file).

The tiny Gemma 3 keeps every *structural* feature of Gemma 3 12B that our loaders and LTX-2's
feature extractor depend on, at toy sizes:

* text tower: hidden 64, intermediate 128, 6 layers, 4 query / 2 KV heads, head_dim 16,
  ``query_pre_attn_scalar`` 16, sliding window 16 (so prompts of 30+ tokens really exercise the
  sliding layers), layer pattern 5 sliding + 1 global, RoPE theta 1e6 with linear scaling
  factor 8 on the global layers and theta 1e4 on the sliding ones (as 12B);
* a one-layer SigLIP vision tower and the multimodal projector (``mm_tokens_per_image`` 4), so
  "the vision tower is not loaded" is a meaningful test;
* a real SentencePiece BPE tokenizer with byte fallback and Gemma's special ids
  (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4, ``<start_of_turn>`` 105,
  ``<end_of_turn>`` 106; the image tokens at the top of the 512-entry vocabulary).

The SentencePiece ``ModelProto`` is built with the ``sentencepiece`` package's own protobuf
bindings (``sentencepiece_model_pb2``) and serialized deterministically; transformers converts it
to the ``tokenizer.json`` (``GemmaConverter``). Its vocabulary is built so that every
multi-character piece has exactly one split into two shorter pieces: the merge order is then
unambiguous and the Hugging Face BPE conversion is provably token-for-token identical to
SentencePiece's own encoder (no tie-breaking differences).

Same seed -> byte-identical files. Public entry points are called by ``ltx_mgpu.assets``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save

from ltx_mgpu.assets.quant_plans import PLANS, quantize_text_tensors
from ltx_mgpu.text.gemma.tokenizer import tokenizer_from_spm
from ltx_mgpu.text.gemma.vision import VISION_CONFIG_METADATA_KEY

#: Tiny Gemma 3 text dimensions (multiples of 64/32 so bitsandbytes' packed CPU NF4 path
#: accepts every projection; see bitsandbytes' ``functional._convert_weight_packed_for_cpu``).
TINY_GEMMA_HIDDEN = 64
TINY_GEMMA_LAYERS = 6
#: Number of hidden states the feature extractor consumes: embeddings + every layer.
TINY_GEMMA_HIDDEN_STATES = TINY_GEMMA_LAYERS + 1
#: Vocabulary of the tiny tokenizer (= the text config's ``vocab_size``).
TINY_GEMMA_VOCAB = 512
#: Gemma 3's special-token ids (google/gemma-3-12b-it tokenizer; ComfyUI ``lt.py``).
PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
START_OF_TURN_ID, END_OF_TURN_ID = 105, 106
#: The 256 byte-fallback pieces ``<0x00>``..``<0xFF>`` start here.
BYTE_PIECES_START = 107
#: Image tokens, at the top of the tiny vocabulary (12B: 255999, 256000, 262144).
BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 509, 510, 511

SPECIAL_PIECES = {
    PAD_ID: "<pad>",
    EOS_ID: "<eos>",
    BOS_ID: "<bos>",
    UNK_ID: "<unk>",
    MASK_ID: "<mask>",
    START_OF_TURN_ID: "<start_of_turn>",
    END_OF_TURN_ID: "<end_of_turn>",
    BOI_ID: "<start_of_image>",
    EOI_ID: "<end_of_image>",
    IMAGE_TOKEN_ID: "<image_soft_token>",
}

# SentencePiece piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type).
SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED, SP_UNUSED, SP_BYTE = 1, 2, 3, 4, 5, 6

_ALPHABET = ["\u2581", "\n", "\t"] + [chr(c) for c in range(33, 127)] + list("éèàüöäñç’“”—…")
_WORDS = [
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by", "be", "this",
    "are", "from", "or", "an", "have", "not", "but", "all", "they", "which", "one", "you", "were", "her", "his",
    "there", "can", "had", "their", "what", "when", "your", "out", "said", "a", "cat", "dog", "red", "blue", "light",
    "camera", "slowly", "walks", "video", "scene", "woman", "man", "city", "night", "sound", "music", "wind", "rain",
]

ComfyWeightFormat = Literal["bf16", "fp16", "fp8_e4m3fn_scaled", "nvfp4", "fp4_mixed", "fp8", "int8", "int8_convrot"]
_FORMATS = ("bf16", "fp16", "fp8_e4m3fn_scaled", *PLANS)


# --------------------------------------------------------------------------- tokenizer


def tiny_spm_pieces() -> list[tuple[str, float, int]]:
    """The tiny tokenizer's pieces as ``(piece, score, type)``, index = token id.

    Normal pieces: the single characters of ``_ALPHABET`` then multi-character pieces drawn from
    ``_WORDS`` (``▁``-prefixed word prefixes and 2-4 character substrings), shortest first, each
    admitted only if it has exactly one split into two already-admitted pieces. Scores are
    ``-rank`` (earlier = merged first), all distinct.
    """
    n_normal = TINY_GEMMA_VOCAB - len(SPECIAL_PIECES) - 256
    admitted = list(_ALPHABET)
    known = set(admitted)
    candidates: list[str] = []
    for word in _WORDS:
        marked = "\u2581" + word
        candidates += [marked[:n] for n in range(2, len(marked) + 1)]
        candidates += [word[i : i + n] for n in range(2, min(4, len(word)) + 1) for i in range(len(word) - n + 1)]
    ordered = sorted(dict.fromkeys(candidates), key=len)  # stable: keeps first-seen order within a length
    for piece in ordered:
        if len(admitted) == n_normal:
            break
        if piece in known:
            continue
        splits = [i for i in range(1, len(piece)) if piece[:i] in known and piece[i:] in known]
        if len(splits) == 1:
            admitted.append(piece)
            known.add(piece)
    if len(admitted) != n_normal:
        raise AssertionError(f"tiny vocabulary has {len(admitted)} normal pieces, expected {n_normal}")

    pieces: list[tuple[str, float, int] | None] = [None] * TINY_GEMMA_VOCAB
    for i, p in SPECIAL_PIECES.items():
        pieces[i] = (p, 0.0, SP_UNKNOWN if i == UNK_ID else SP_CONTROL)
    for b in range(256):
        pieces[BYTE_PIECES_START + b] = (f"<0x{b:02X}>", 0.0, SP_BYTE)
    normal = iter(enumerate(admitted))
    for i in range(TINY_GEMMA_VOCAB):
        if pieces[i] is None:
            rank, p = next(normal)
            pieces[i] = (p, float(-rank), SP_NORMAL)
    return pieces  # type: ignore[return-value]


def build_tiny_spm_model() -> bytes:
    """Serialized SentencePiece ``ModelProto`` of the tiny Gemma tokenizer (deterministic bytes).

    Settings mirror Gemma 3's tokenizer: BPE, byte fallback, split digits, whitespace-only pieces
    allowed, no dummy prefix, whitespace kept and escaped to ``▁``, identity normalisation, ids
    unk 3 / bos 2 / eos 1 / pad 0. Built with ``sentencepiece_model_pb2`` (field meanings:
    ``sentencepiece_model.proto``); every field is set explicitly and serialized with
    ``deterministic=True``, so the bytes depend only on this code.
    """
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    model = spm_pb2.ModelProto()
    for piece, score, kind in tiny_spm_pieces():
        model.pieces.add(piece=piece, score=score, type=kind)
    model.trainer_spec.MergeFrom(
        spm_pb2.TrainerSpec(
            model_type=spm_pb2.TrainerSpec.BPE,
            vocab_size=TINY_GEMMA_VOCAB,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            unk_piece=SPECIAL_PIECES[UNK_ID],
            bos_piece=SPECIAL_PIECES[BOS_ID],
            eos_piece=SPECIAL_PIECES[EOS_ID],
            pad_piece=SPECIAL_PIECES[PAD_ID],
        )
    )
    model.normalizer_spec.MergeFrom(
        spm_pb2.NormalizerSpec(
            name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False, escape_whitespaces=True
        )
    )
    return model.SerializeToString(deterministic=True)


#: The snapshot's ``tokenizer_config.json``: what transformers needs to rebuild the tokenizer from
#: ``tokenizer.json`` as Gemma 3's (google/gemma-3-12b-it ``tokenizer_config.json``, reduced):
#: BOS first, no EOS, left padding, Gemma's special-token names.
TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "backend": "tokenizers",
    "bos_token": SPECIAL_PIECES[BOS_ID],
    "eos_token": SPECIAL_PIECES[EOS_ID],
    "extra_special_tokens": [
        SPECIAL_PIECES[i] for i in (START_OF_TURN_ID, END_OF_TURN_ID, BOI_ID, EOI_ID, IMAGE_TOKEN_ID)
    ],
    "mask_token": SPECIAL_PIECES[MASK_ID],
    "model_max_length": 131072,
    "pad_token": SPECIAL_PIECES[PAD_ID],
    "padding_side": "left",
    "tokenizer_class": "GemmaTokenizer",
    "unk_token": SPECIAL_PIECES[UNK_ID],
}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_tokenizer(out_dir: Path) -> None:
    """``tokenizer.model``, the ``tokenizer.json`` transformers converts it to, and
    :data:`TOKENIZER_CONFIG` (written by us: transformers' own would record the load path)."""
    spm_bytes = build_tiny_spm_model()
    (out_dir / "tokenizer.model").write_bytes(spm_bytes)
    tokenizer_from_spm(spm_bytes).backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", TOKENIZER_CONFIG)


# --------------------------------------------------------------------------- model


def tiny_gemma_config():
    """The tiny ``Gemma3Config`` (text + SigLIP vision); see the module docstring for sizes.

    Source of the 12B-like choices: google/gemma-3-12b-it ``config.json`` (sliding pattern 6,
    ``rope_scaling`` linear factor 8 on global layers, local base 1e4, eos ``[1, 106]``).
    """
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=TINY_GEMMA_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, END_OF_TURN_ID],
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        image_token_index=IMAGE_TOKEN_ID,
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, END_OF_TURN_ID],
        pad_token_id=PAD_ID,
    )


def build_tiny_gemma_snapshot(out_dir: Path, seed: int = 0) -> None:
    """Write a tiny ``Gemma3ForConditionalGeneration`` Hugging Face snapshot into ``out_dir``.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, original
    multimodal key layout ``language_model.model.*`` / ``vision_tower.*`` /
    ``multi_modal_projector.*``, as transformers 5 writes by default), ``tokenizer.model``
    (SentencePiece), ``tokenizer.json`` and ``tokenizer_config.json`` (left padding, BOS, no EOS).
    The model is built with ``_from_config(dtype=bfloat16)`` under ``torch.manual_seed(seed)``
    (never ``.to(bfloat16)``: that would also cast the fp32 RoPE buffers); the multi-modal
    projector's matrix, which transformers initialises to zeros, is drawn from N(0, 0.5^2) so an
    image's content reaches the text tower.
    Same ``seed`` -> byte-identical files.
    """
    from transformers import Gemma3ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_gemma_config()
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
        # transformers leaves the projector's matrix at zeros (every image would read as nothing)
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    finally:
        torch.random.set_rng_state(rng_state)
    model.save_pretrained(str(out_dir))
    _save_tokenizer(out_dir)


# --------------------------------------------------------------------------- ComfyUI file


def _comfy_key(hf_key: str) -> str | None:
    """Map a multimodal HF key (either layout) to ComfyUI's Gemma 3 key; None = drop.

    ComfyUI (``comfy/text_encoders/llama.py``, ``Gemma3_12B``): text ``model.*`` (a ``Llama2_``
    with ``embed_tokens``, ``layers.N.{self_attn,mlp,*_layernorm}``, ``norm``), vision
    ``vision_model.*`` (``comfy.clip_model.CLIPVision``), ``multi_modal_projector.*``.
    """
    for src, dst in (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("vision_tower.vision_model.", "vision_model."),  # google/gemma-3-* checkpoints
        ("model.vision_tower.vision_model.", "vision_model."),
        ("vision_tower.", "vision_model."),  # what transformers 5.24 writes
        ("model.vision_tower.", "vision_model."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if hf_key.startswith(src):
            return dst + hf_key[len(src) :]
    return None  # lm_head (tied to embed_tokens)


def _is_fp8_target(key: str) -> bool:
    """ComfyUI's scaled-fp8 files quantise the text linears only (norms, embeddings stay high)."""
    return key.startswith("model.layers.") and key.endswith("_proj.weight")


def build_tiny_gemma_comfy_file(snapshot_dir: Path, out_path: Path, weight_format: ComfyWeightFormat = "bf16") -> None:
    """Write the snapshot's weights as a ComfyUI single-file Gemma 3 text encoder.

    Layout (ComfyUI ``comfy/text_encoders/llama.py`` / ``lt.py``): text ``model.layers.N.*``,
    ``model.embed_tokens.weight``, ``model.norm.weight``; vision ``vision_model.*``;
    ``multi_modal_projector.*``; the SentencePiece tokenizer as a uint8 tensor ``spiece_model``.
    The text config goes into the safetensors header metadata under ``ltx_mgpu_gemma_config``
    (JSON), since tiny dims cannot be inferred from 12B defaults, and the vision config with
    ``mm_tokens_per_image`` under ``ltx_mgpu_gemma_vision_config``
    (``ltx_mgpu.text.gemma.vision.VISION_CONFIG_METADATA_KEY``: heads and tokens per image are
    not in the shapes).

    ``weight_format``: ``"bf16"`` (as stored in the snapshot), ``"fp16"`` (every float tensor
    cast), ``"fp8_e4m3fn_scaled"`` (text linear weights stored as ``float8_e4m3fn`` with a
    per-tensor fp32 ``<layer>.weight_scale`` = amax / 448, ComfyUI's ``QUANTIZATION.md`` format,
    plus ``_quantization_metadata`` in the header, the older way of marking layers), or one of
    ``ltx_mgpu.assets.quant_plans.PLANS`` (``"nvfp4"``, ``"fp4_mixed"``, ``"fp8"``, ``"int8"``,
    ``"int8_convrot"``: the text projections in ComfyUI's quantized layouts, each layer with its
    ``comfy_quant`` marker). Deterministic bytes.

    Raises:
        FileNotFoundError: ``snapshot_dir`` lacks ``model.safetensors``, ``config.json`` or
            ``tokenizer.model``.
        ValueError: unknown ``weight_format``.
    """
    if weight_format not in _FORMATS:
        raise ValueError(f"weight_format must be one of {_FORMATS}, got {weight_format!r}")
    snapshot_dir = Path(snapshot_dir)
    hf = load_file(str(snapshot_dir / "model.safetensors"))
    config = json.loads((snapshot_dir / "config.json").read_text(encoding="utf-8"))
    spm_bytes = (snapshot_dir / "tokenizer.model").read_bytes()

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for hf_key in sorted(hf):
        key = _comfy_key(hf_key)
        if key is None:
            continue
        t = hf[hf_key]
        if weight_format == "fp16" and t.is_floating_point():
            t = t.to(torch.float16)
        elif weight_format == "fp8_e4m3fn_scaled" and _is_fp8_target(key):
            w = t.float()
            scale = (w.abs().amax() / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
            t = (w / scale).to(torch.float8_e4m3fn)
            tensors[key[: -len("weight")] + "weight_scale"] = scale.reshape(())
            quantized[key[: -len(".weight")]] = {"format": "float8_e4m3fn"}
        tensors[key] = t.contiguous()
    if weight_format in PLANS:
        tensors, _ = quantize_text_tensors(tensors, weight_format, config["text_config"]["num_hidden_layers"])
    tensors["spiece_model"] = torch.frombuffer(bytearray(spm_bytes), dtype=torch.uint8)

    vision = {"vision_config": config["vision_config"], "mm_tokens_per_image": config["mm_tokens_per_image"]}
    metadata = {"format": "pt", "ltx_mgpu_gemma_config": json.dumps(config["text_config"], sort_keys=True),
                VISION_CONFIG_METADATA_KEY: json.dumps(vision, sort_keys=True)}
    if quantized:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": quantized}, sort_keys=True)
    _write_safetensors_canonical(tensors, Path(out_path), metadata)


def _write_safetensors_canonical(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save`` with the JSON header's keys sorted, written atomically.

    safetensors serialises ``__metadata__`` from a Rust ``HashMap``, whose iteration order
    differs between calls; sorting the (same-length, same-content) header restores byte
    determinism. Tensor data order is already deterministic (by alignment, then name).
    """
    blob = save(tensors, metadata=metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.dumps(json.loads(blob[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    if len(header) > n:
        raise AssertionError("canonical safetensors header is longer than the original")
    blob = blob[:8] + header + b" " * (n - len(header)) + blob[8 + n :]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
