"""Load the Gemma 3 *text tower* for LTX-2 text encoding: :func:`load_gemma_text_tower`.

Only ``Gemma3TextModel`` is built: no vision tower, no multimodal projector, no ``lm_head``
(LTX-2 consumes hidden states only). The sources (HF snapshot directory, ComfyUI single file,
NF4 artifact) are detected and identified by :mod:`ltx_mgpu.text.gemma.sources`; tokenizers are
built by :mod:`ltx_mgpu.text.gemma.tokenizer`; stored keys map to the model's by
:mod:`ltx_mgpu.text.gemma.keys`.

Both bf16 sources go through transformers' own ``from_pretrained`` loader (meta-device init,
weights assigned, RoPE ``inv_freq`` buffers computed in fp32), and every load is checked for
missing text-tower keys: ``Gemma3TextModel.from_pretrained(<multimodal dir>)`` otherwise
*silently* initialises random weights. NF4 (an artifact, or ``weights="nf4"``) is dispatched
to :mod:`ltx_mgpu.text.nf4.load`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ltx_mgpu.choices import WEIGHTS, check_choice
from ltx_mgpu.quantized.packed import PACKED_TYPES, PackedEmbedding, PackedLinear, swap_packed_linears
from ltx_mgpu.text.gemma.comfy_file import open_comfy_file
from ltx_mgpu.text.gemma.forward import offload_embeddings, use_causal_skip
from ltx_mgpu.text.gemma.gguf_file import open_gemma_gguf
from ltx_mgpu.text.gemma.keys import SNAPSHOT_KEY_MAPPING, TEXT_KEY
from ltx_mgpu.text.gemma.sources import (
    GemmaWeightsError,
    detect_gemma_format,
    find_tokenizer_files,
    no_tokenizer_error,
)
from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, comfy_file_tokenizer, load_tokenizer
from ltx_mgpu.text.gemma.tower import GemmaTextTower
from ltx_mgpu.text.nf4 import kernel as nf4_kernel
from ltx_mgpu.text.nf4.dequant import FastDequant
from ltx_mgpu.text.nf4.load import load_nf4, load_nf4_on_the_fly

__all__ = ["load_gemma_text_tower"]



# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _without_load_report():
    """Drop transformers' "LOAD REPORT" warning: the vision keys it lists as unexpected are skipped on
    purpose, and missing keys are raised by :func:`_check_loading_info` instead."""
    logger = logging.getLogger("transformers.modeling_utils")

    def keep(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _check_loading_info(info: dict, source: Path) -> None:
    """Raise unless every text-tower weight came from the checkpoint (no silent random init)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    stray = sorted(k for k in (info.get("unexpected_keys") or []) if TEXT_KEY.match(k))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing text-tower weight(s): {missing[:20]}")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) with a shape not matching the config: {mismatched[:20]}")
    if stray:
        problems.append(f"{len(stray)} text-tower weight(s) the config has no place for: {stray[:20]}")
    if problems:
        raise GemmaWeightsError(
            f"{source}: the Gemma 3 text-tower weights do not match the config: " + "; ".join(problems)
            + ". The file is incomplete or belongs to another model; re-download or re-export it."
        )


def _load_snapshot(d: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    from transformers import AutoConfig, Gemma3TextModel

    cfg = AutoConfig.from_pretrained(str(d))
    text_cfg = cfg.text_config if cfg.model_type == "gemma3" else cfg
    with _without_load_report():
        model, info = Gemma3TextModel.from_pretrained(
            str(d),
            config=text_cfg,
            key_mapping=SNAPSHOT_KEY_MAPPING,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map={"": device},
            use_safetensors=True,
            ignore_mismatched_sizes=True,  # reported in the loading info, raised by _check_loading_info
            output_loading_info=True,
        )
    _check_loading_info(info, d)
    found = find_tokenizer_files(d)
    if found is None:
        raise no_tokenizer_error(d)
    tok = check_tokenizer(load_tokenizer(found), d)
    files = (d / "config.json", *sorted(d.glob("*.safetensors")), *found.files)
    return GemmaTextTower(model.eval(), tok, text_cfg, "hf_snapshot", d, files)


def _load_comfy(path: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    from transformers import Gemma3TextModel

    src = open_comfy_file(path)
    cfg = src.config()
    # quantized layers are dequantized on the target device, straight into ``dtype`` (as ComfyUI
    # does for activations of that dtype); plain tensors are cast by transformers' loader
    state = {name: src.lazy(name, device, dtype) for name in src.shapes}
    with _without_load_report():
        model, info = Gemma3TextModel.from_pretrained(
            None,
            config=cfg,
            state_dict=state,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map={"": device},
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    _check_loading_info(info, path)
    tok, tok_files = comfy_file_tokenizer(path, src.spm)
    return GemmaTextTower(model.eval(), check_tokenizer(tok, path), cfg, "comfy_file", path, (path, *tok_files))


def _load_gguf(path: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    """A Gemma 3 GGUF (``ltx_mgpu.text.gemma.gguf_file``): the model built on the meta device in
    ``dtype``, its quantized linears and embedding swapped for packed layers
    (``ltx_mgpu.quantized.packed``), given storage on ``device`` and filled one tensor at a time
    from the memory-mapped file; the RoPE tables are then computed there, as transformers' own
    loader computes them (float32)."""
    from transformers import Gemma3TextModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    src = open_gemma_gguf(path)
    cfg = src.config()
    cfg._attn_implementation = attn_implementation  # what from_pretrained(attn_implementation=...) sets
    with torch.device("meta"):
        model = Gemma3TextModel(cfg).to(dtype)
    names = src.names(model)
    linears = {n[: -len(".weight")]: src.qtype(f) for n, f in names.items()
               if n.endswith("_proj.weight") and src.qtype(f) in PACKED_TYPES}
    swap_packed_linears(model, linears)
    embed = model.embed_tokens
    if src.qtype(names["embed_tokens.weight"]) in PACKED_TYPES:
        model.embed_tokens = PackedEmbedding(embed.num_embeddings, embed.embedding_dim,
                                             src.qtype(names["embed_tokens.weight"]), dtype,
                                             scale=float(cfg.hidden_size) ** 0.5, padding_idx=embed.padding_idx)
    model.to_empty(device=device)
    with torch.no_grad():
        for key, name in names.items():
            module = model.get_submodule(key.rpartition(".")[0])
            if isinstance(module, (PackedLinear, PackedEmbedding)):
                module.packed().copy_(src.packed(name))
            else:
                model.get_parameter(key).copy_(src.dense(name, dtype))
        if not isinstance(model.embed_tokens, PackedEmbedding):
            model.embed_tokens.embed_scale = torch.tensor(float(cfg.hidden_size) ** 0.5, device=device)
    model.rotary_emb = Gemma3RotaryEmbedding(cfg, device=device)
    tok, tok_files = comfy_file_tokenizer(path, src.spm() if src.has_tokenizer else None)
    return GemmaTextTower(model.eval(), check_tokenizer(tok, path), cfg, "gguf_file", path, (path, *tok_files))


def load_gemma_text_tower(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    weights: str = "bf16",
    save_nf4_to: str | os.PathLike | None = None,
    host_embeddings: bool | None = None,
    layer_dequant: bool | None = None,
) -> GemmaTextTower:
    """Load only the Gemma 3 text tower (``Gemma3TextModel``) and its tokenizer.

    Args:
        path: an HF snapshot directory, a ComfyUI single-file ``.safetensors``, a Gemma 3 GGUF
            file (``ltx_mgpu.text.gemma.sources`` describes them; a GGUF's quantized layers stay
            packed, ``ltx_mgpu.quantized.packed``), or an ltx_mgpu NF4 artifact
            directory (always loaded as NF4, whatever ``weights`` says: ``ltx_mgpu.text.nf4.load.load_nf4``).
        device: where the weights are placed.
        dtype: weight dtype; other stored dtypes are cast to it. A ComfyUI file's quantized
            layers (nvfp4, fp8, int8: ``ltx_mgpu.text.gemma.comfy_file``) are dequantized into it
            as ComfyUI does for activations of that dtype. NF4 requires bf16.
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        weights: ``"bf16"`` (plain weights in ``dtype``) or ``"nf4"`` (quantized while loading:
            ``ltx_mgpu.text.nf4.load.load_nf4_on_the_fly``).
        save_nf4_to: with ``weights="nf4"`` from a bf16 source, also write the NF4 artifact here.
        host_embeddings: keep the token-embedding table in host memory
            (``ltx_mgpu.text.gemma.forward.offload_embeddings``: 2.0 GB less GPU memory for Gemma 3 12B,
            bit-identical results); ``None`` (default) does it for NF4 weights on a GPU, where it
            is a quarter of the tower's memory.
        layer_dequant: for NF4, dequantize each decoder layer's seven projections at once into
            a reused bf16 buffer (449 MB for 12B) and run cuBLAS GEMMs on it
            (``ltx_mgpu.text.nf4.dequant.FastDequant``, ``scope="layer"``) instead of
            bitsandbytes' per-``Linear4bit`` path; same outputs up to the GEMM (the dequant is
            bit-identical). The kernel is one Triton launch per layer (``method="triton"``,
            ``ltx_mgpu.text.nf4.kernel``; the next layer's on a side stream, a second buffer)
            where Triton is installed, else bitsandbytes' (``"bnb"``). ``None`` (default): on a
            single GPU (``benchmarks/bench_nf4.py`` times it).

    The tower uses ``ltx_mgpu.text.gemma.forward.ATTENTION`` when ``attn_implementation="sdpa"``
    (SDPA that takes the causal kernel whenever a batch has no padding).

    Returns:
        The tower; ``tower.weights`` says what was actually loaded (``"nf4"`` for an artifact).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: unsupported source, quantization or tokenizer (names the supported formats).
        GemmaWeightsError: text-tower weights missing, mis-shaped or unexpected for the config
            (``NF4ArtifactError`` for a damaged artifact).
        ValueError: ``weights`` is not one of :data:`ltx_mgpu.choices.WEIGHTS`; NF4 with a dtype other than
            bf16 or from a GGUF file; ``save_nf4_to`` without ``weights="nf4"`` or with an artifact as source.
    """
    check_choice(weights, WEIGHTS, "weights")
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact":
        if save_nf4_to is not None:
            raise ValueError(f"{p} is already an NF4 artifact; save_nf4_to applies to bf16 sources only")
        tower = load_nf4(p, device, dtype, attn_implementation)
    elif weights == "nf4" and fmt == "gguf_file":
        raise ValueError(f"{p} is a GGUF file, already quantized: choose weights 'bf16' for it (its quantized "
                         "blocks stay quantized on the GPU and compute in bf16); weights 'nf4' quantizes a bf16 source")
    elif weights == "nf4":
        tower = load_nf4_on_the_fly(p, device, dtype, attn_implementation, save_to=save_nf4_to)
    elif save_nf4_to is not None:
        raise ValueError("save_nf4_to needs weights='nf4' (it saves the NF4 artifact made while loading)")
    else:
        load = {"hf_snapshot": _load_snapshot, "comfy_file": _load_comfy, "gguf_file": _load_gguf}[fmt]
        tower = load(p, torch.device(device), dtype, attn_implementation)
    use_causal_skip(tower.model)
    nf4_on_gpu = tower.weights == "nf4" and tower.device.type == "cuda"
    if host_embeddings if host_embeddings is not None else nf4_on_gpu:
        offload_embeddings(tower.model)
    if tower.weights == "nf4" and (layer_dequant if layer_dequant is not None else nf4_on_gpu):
        # kept alive by its hooks on the layers. With the Triton kernel the next layer is
        # dequantized on a side stream (a second 449 MB buffer): its launch costs the host
        # almost nothing, and at 1x1024 tokens the eager forward leaves the GPU idle between
        # host-bound launches, where the dequant then runs, so the prefetch pays
        # (``benchmarks/bench_nf4.py`` measures it). bitsandbytes' kernel is host-bound itself:
        # no prefetch (it gains nothing there).
        triton = tower.device.type == "cuda" and nf4_kernel.available()
        FastDequant(tower.model, method="triton" if triton else "bnb", scope="layer", prefetch=triton)
    return tower
