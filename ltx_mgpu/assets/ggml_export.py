"""LTX-2 transformer and Gemma 3 files as GGUF, the way the community's converters write them,
for the tests and the benchmarks: an LTX-2 DiT as ComfyUI-GGUF's ``tools/convert.py`` writes it
(the DiT's keys as tensor names, ``general.architecture`` ``ltxv``, the ``config`` metadata kept
as a string field), a Gemma 3 as llama.cpp's ``convert_hf_to_gguf.py`` writes it
(:func:`export_gemma_gguf`).

:func:`export_gguf` writes a safetensors DiT file as GGUF with a GGML type per tensor. The types
``gguf`` can quantize (``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``) are quantized from
the source's values; the K-quants, for which no quantizer is at hand, get random blocks (every
code and sub-scale bit pattern, fp16 scales drawn so the values keep the source's magnitude):
then the file does not hold the source's weights, and :func:`dequantized_copy` writes what it
does hold, the reference the loaders are compared with.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from ltx_mgpu.files import write_atomically
from ltx_mgpu.quantized.ggml import BLOCK_SHAPES, GGUFFile, dequantize

__all__ = ["QUANTIZABLE", "block_linear_types", "dequantized_copy", "export_gemma_gguf", "export_gguf"]

#: The GGML types ``gguf.quants.quantize`` encodes (the others are written as random blocks).
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
#: The byte offsets of each K-quant block's fp16 scales (``d``, and ``dmin`` where there is one),
#: llama.cpp's ``ggml-common.h`` block layouts.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
#: The largest code times sub-scale of each K-quant (what an fp16 scale ``d`` multiplies).
_K_RANGE = {"Q2_K": 15 * 3, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}


def block_linear_types(qtype: str) -> Callable[[str, tuple[int, ...]], str]:
    """The converters' rule: the blocks' 2-D weights whose rows are whole ``qtype`` blocks in
    ``qtype``, everything else ``F32`` (1-D tensors, small or odd-sized ones, ComfyUI-GGUF's
    ``keys_hiprec`` such as ``scale_shift_table``)."""
    block = BLOCK_SHAPES[qtype][0]

    def rule(key: str, shape: tuple[int, ...]) -> str:
        quantized = (key.startswith("transformer_blocks.") and key.endswith(".weight") and len(shape) == 2
                     and shape[-1] % block == 0)
        return qtype if quantized else "F32"

    return rule


def _random_k_blocks(qtype: str, shape: tuple[int, ...], magnitude: float, key: str) -> np.ndarray:
    """Random ``qtype`` blocks for a tensor of ``shape`` whose values stay within ``magnitude``
    (seeded by ``key``), ``[rows, row bytes]`` uint8."""
    block, size = BLOCK_SHAPES[qtype]
    rows, n = int(np.prod(shape[:-1])), shape[-1] // block
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    raw = rng.integers(0, 256, (rows * n, size), dtype=np.uint8)
    d = (rng.uniform(0.25, 1.0, (rows * n, 1)) * magnitude / _K_RANGE[qtype]).astype(np.float16)
    for offset in _K_SCALES[qtype]:
        raw[:, offset:offset + 2] = d.view(np.uint8)
    return raw.reshape(rows, n * size)


def export_gguf(src: str | os.PathLike, dst: str | os.PathLike,
                types: Callable[[str, tuple[int, ...]], str] | Mapping[str, str], *,
                keep_config: bool = True, prefix: str = "") -> Path:
    """Write the DiT of safetensors file ``src`` (a transformer-only file or a monolith's
    ``model.diffusion_model.*``) as GGUF ``dst``, each tensor in ``types(key, shape)`` (or
    ``types[key]``, default ``F32``); keys are written with ``prefix`` (``""`` as the converters do,
    or ``"model.diffusion_model."``). Returns ``dst``.

    Raises:
        ValueError: a type outside :data:`ltx_mgpu.quantized.ggml.READABLE`, or a tensor whose rows
            are not whole blocks of its type.
    """
    import gguf  # deferred: only GGUF files need it

    from ltx_mgpu.denoise.checkpoint import inspect_checkpoint  # deferred: ltx-core, for the DiT's key layout

    info = inspect_checkpoint(src)
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "ltxv")
    if keep_config:
        writer.add_string("config", json.dumps(info.config))
    with safe_open(str(src), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            if not key.startswith(info.prefix):
                continue
            full = key[len(info.prefix):]
            t = f.get_tensor(key).float()
            shape = tuple(t.shape)
            qtype = types(full, shape) if callable(types) else types.get(full, "F32")
            if qtype not in BLOCK_SHAPES or (shape and shape[-1] % BLOCK_SHAPES[qtype][0]):
                raise ValueError(f"{full} {shape}: cannot be written as {qtype}")
            values = t.numpy()
            if qtype in QUANTIZABLE:
                data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
            else:
                magnitude = float(np.abs(values).max()) if values.size else 1.0
                data = _random_k_blocks(qtype, shape, max(magnitude, 1e-3), full)
            writer.add_tensor(prefix + full, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def dequantized_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the values GGUF file ``src`` holds, dequantized to float32 (``gguf``'s values), as a
    transformer-only safetensors file ``dst`` with the same keys and ``config`` metadata: the
    dense reference of a GGUF load. Returns ``dst``."""
    f = GGUFFile(src)
    tensors = {name: dequantize(f.read(name), t.qtype, t.shape).contiguous() for name, t in f.tensors.items()}
    config = f.field("config")
    meta = {"config": config} if isinstance(config, str) else None
    return write_atomically(Path(dst), save(tensors, metadata=meta))


def export_gemma_gguf(source: str | os.PathLike, dst: str | os.PathLike, qtype: str = "Q8_0") -> Path:
    """Write the Gemma 3 text tower of ``source`` (any Gemma source ltx_mgpu loads with a
    SentencePiece ``tokenizer.model``) as a llama.cpp GGUF ``dst``: gguf's tensor names
    (``blk.N.attn_q.weight``...), the RMSNorm weights plus one, the ``gemma3.*`` fields and the
    tokenizer's pieces, scores and types; the 2-D weights whose rows are whole ``qtype`` blocks in
    ``qtype`` (one of :data:`QUANTIZABLE`), the rest F32. Returns ``dst``.

    Raises:
        FileNotFoundError: ``source`` has no ``tokenizer.model``. ValueError: ``qtype`` is not
            quantizable here.
    """
    import gguf  # deferred: only GGUF files need it
    from sentencepiece import sentencepiece_model_pb2 as spm

    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower  # deferred: transformers

    if qtype not in QUANTIZABLE:
        raise ValueError(f"qtype must be one of {QUANTIZABLE}, got {qtype!r}")
    src = Path(source)
    spm_path = src / "tokenizer.model" if src.is_dir() else src.parent / "tokenizer.model"
    proto = spm.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    tower = load_gemma_text_tower(src, dtype=torch.float32)
    cfg, model = tower.config, tower.model
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "gemma3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    full = cfg.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([int(p.type) for p in proto.pieces])
    spec = proto.trainer_spec
    writer.add_bos_token_id(spec.bos_id)
    writer.add_eos_token_id(spec.eos_id)
    writer.add_unk_token_id(spec.unk_id)
    writer.add_pad_token_id(spec.pad_id)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    block = BLOCK_SHAPES[qtype][0]
    for key, value in model.state_dict().items():
        stem, _, suffix = key.rpartition(".")
        values = value.float().numpy()
        if key.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma's 1 + w
        kind = qtype if values.ndim == 2 and values.shape[-1] % block == 0 else "F32"
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        writer.add_tensor(f"{table.get_name('model.' + stem)}.{suffix}", data,
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst
