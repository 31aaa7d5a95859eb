"""Load the Gemma 3 *text tower* for LTX-2 text encoding, run it, and compile it.

Only ``Gemma3TextModel`` is built: no vision tower, no multimodal projector, no ``lm_head``
(LTX-2 consumes hidden states only). The sources (HF snapshot directory, ComfyUI single file,
NF4 artifact) are detected and identified by ``ltx_mgpu.text.gemma_sources``; tokenizers are built
and prompts tokenized by ``ltx_mgpu.text.tokenizer``. Their public names are re-exported here.

Both bf16 sources go through transformers' own ``from_pretrained`` loader (meta-device init,
weights assigned, RoPE ``inv_freq`` buffers computed in fp32), and every load is checked for
missing text-tower keys: ``Gemma3TextModel.from_pretrained(<multimodal dir>)`` otherwise
*silently* initialises random weights. NF4 (an artifact, or ``weights="nf4"``) is dispatched
to ``ltx_mgpu.text.nf4``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ltx_mgpu.text.gemma_sources import (
    SUPPORTED_FORMATS,
    GemmaFormatError,
    GemmaWeightsError,
    comfy_text_config,
    comfy_tokenizer_files,
    detect_gemma_format,
    find_tokenizer_files,
    gemma3_text_config,
    gemma_identity,
    gemma_source_files,
    no_tokenizer_error,
    source_identity,
)
from ltx_mgpu.text.forward import compile_text_tower, copy_sharing_weights, encode_hidden_states
from ltx_mgpu.text.tokenizer import PromptTooLongError, check_tokenizer, load_tokenizer, tokenize, tokenizer_from_spm

__all__ = [
    "GemmaTextTower",
    "load_gemma_text_tower",
    "encode_hidden_states",
    "compile_text_tower",
    "copy_sharing_weights",
    # re-exported from ltx_mgpu.text.gemma_sources / ltx_mgpu.text.tokenizer
    "GemmaFormatError",
    "GemmaWeightsError",
    "PromptTooLongError",
    "SUPPORTED_FORMATS",
    "detect_gemma_format",
    "gemma_identity",
    "gemma_source_files",
    "gemma3_text_config",
    "tokenize",
    "tokenizer_from_spm",
]

#: Multimodal / text-only prefixes stripped to reach Gemma3TextModel keys.
_SNAPSHOT_KEY_MAPPING = {r"^(?:language_model\.model|model\.language_model|model)\.": ""}
_TEXT_KEY = re.compile(r"^(?:layers\.\d+\.|embed_tokens\.|norm\.)")
_COMFY_AUX_SUFFIXES = (".weight_scale", ".scale_weight", ".input_scale", ".scale_input", ".comfy_quant")


@dataclass
class GemmaTextTower:
    """A loaded Gemma 3 text tower and its tokenizer.

    Attributes:
        model: ``Gemma3TextModel`` in eval mode (weights in the requested dtype, RoPE buffers fp32).
        tokenizer: HF tokenizer: left padding, ``<bos>`` prepended, no ``<eos>``.
        config: the ``Gemma3TextConfig``.
        format: ``"hf_snapshot"``, ``"comfy_file"`` or ``"nf4_artifact"`` (the source's format).
        path: the source path as given.
        files: the files whose bytes define the outputs (weights, config, tokenizer).
        weights: what is loaded: ``"bf16"`` (plain weights) or ``"nf4"`` (bitsandbytes
            ``Linear4bit`` projections; ``ltx_mgpu.text.nf4``), whatever was asked for.
    """

    model: Any
    tokenizer: Any
    config: Any
    format: str
    path: Path
    files: tuple[Path, ...] = field(default=())
    weights: str = "bf16"

    @functools.cached_property
    def identity(self) -> str:
        """Content identity of the source (see :func:`gemma_identity`); computed on first use."""
        return source_identity(Path(self.path), self.files)

    @property
    def num_hidden_states(self) -> int:
        """``L = num_hidden_layers + 1`` (embedding output + one per decoder layer); 49 for 12B."""
        return int(self.config.num_hidden_layers) + 1

    @property
    def hidden_size(self) -> int:
        """Hidden width ``D`` (3840 for Gemma 3 12B)."""
        return int(self.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Where the decoder layers run (the first layer's device under an Accelerate map; the
        embedding table may be elsewhere: ``ltx_mgpu.text.forward.offload_embeddings``)."""
        from ltx_mgpu.text.forward import layers_device

        return layers_device(self.model)


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
    stray = sorted(k for k in (info.get("unexpected_keys") or []) if _TEXT_KEY.match(k))
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
            key_mapping=_SNAPSHOT_KEY_MAPPING,
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


class _ScaledFp8:
    """Lazy fp8 -> fp32 dequantisation of one safetensors slice: ``w.float() * scale``.

    Exposes ``[...]`` like a safetensors slice, which is all transformers' loader uses.
    """

    def __init__(self, slice_: Any, scale: torch.Tensor | None):
        self._slice, self._scale = slice_, scale

    def __getitem__(self, index: Any) -> torch.Tensor:
        w = self._slice[...].to(torch.float32)
        if self._scale is not None:
            w = w * self._scale.to(torch.float32)
        return w[index]


def _comfy_tokenizer(path: Path, spm_bytes: bytes | None) -> tuple[Any, tuple[Path, ...]]:
    """The embedded ``spiece_model`` if any, else a tokenizer beside the file; with its files."""
    if spm_bytes is not None:
        try:
            return tokenizer_from_spm(spm_bytes), ()
        except GemmaFormatError as exc:
            raise GemmaFormatError(f"{path}: embedded 'spiece_model': {exc}") from exc
    found = comfy_tokenizer_files(path)
    if found is None:
        raise no_tokenizer_error(path)
    return load_tokenizer(found), found.files


def _load_comfy(path: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    from safetensors import safe_open
    from transformers import Gemma3TextModel

    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        meta = dict(f.metadata() or {})
        spm_bytes = f.get_tensor("spiece_model").numpy().tobytes() if "spiece_model" in keys else None
        state: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for key in sorted(keys):
            if not key.startswith("model.") or key.endswith(_COMFY_AUX_SUFFIXES):
                continue
            sl = f.get_slice(key)
            shapes[key] = tuple(sl.get_shape())
            kind = sl.get_dtype()
            if kind in ("F8_E4M3", "F8_E5M2"):
                base = key[: -len(".weight")] if key.endswith(".weight") else key
                scale_key = next((k for k in (base + ".weight_scale", base + ".scale_weight") if k in keys), None)
                sl = _ScaledFp8(sl, f.get_tensor(scale_key) if scale_key else None)
            elif kind not in ("BF16", "F16", "F32"):
                raise GemmaFormatError(
                    f"{path}: tensor {key} is stored as {kind}; quantized ComfyUI formats other than fp8 e4m3 "
                    "(e.g. nvfp4 'fp4_mixed', int8) are not supported. Use the bf16, fp16 or fp8 Gemma 3 file."
                )
            state[key[len("model.") :]] = sl
        cfg = comfy_text_config(meta, shapes, path)
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
    tok, tok_files = _comfy_tokenizer(path, spm_bytes)
    return GemmaTextTower(model.eval(), check_tokenizer(tok, path), cfg, "comfy_file", path, (path, *tok_files))


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
        path: an HF snapshot directory, a ComfyUI single-file ``.safetensors``
            (``ltx_mgpu.text.gemma_sources`` describes both), or an ltx_mgpu NF4 artifact
            directory (always loaded as NF4, whatever ``weights`` says: ``ltx_mgpu.text.nf4.load_nf4``).
        device: where the weights are placed.
        dtype: weight dtype; fp16/fp8 source weights are upcast to it (fp8 times its scale).
            NF4 requires bf16.
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        weights: ``"bf16"`` (plain weights in ``dtype``) or ``"nf4"`` (quantized while loading:
            ``ltx_mgpu.text.nf4.load_nf4_on_the_fly``).
        save_nf4_to: with ``weights="nf4"`` from a bf16 source, also write the NF4 artifact here.
        host_embeddings: keep the token-embedding table in host memory
            (``ltx_mgpu.text.forward.offload_embeddings``: 2.0 GB less GPU memory for Gemma 3 12B,
            bit-identical results); ``None`` (default) does it for NF4 weights on a GPU, where it
            is a quarter of the tower's memory.
        layer_dequant: for NF4, dequantize each decoder layer's seven projections at once into
            a reused bf16 buffer (449 MB for 12B) and run cuBLAS GEMMs on it
            (``ltx_mgpu.text.nf4_dequant.FastDequant``, ``scope="layer"``) instead of
            bitsandbytes' per-``Linear4bit`` path; same outputs up to the GEMM (the dequant is
            bit-identical). The kernel is one Triton launch per layer (``method="triton"``,
            ``ltx_mgpu.text.nf4_triton``; the next layer's on a side stream, a second buffer)
            where Triton is installed, else bitsandbytes' (``"bnb"``). ``None`` (default): on a
            single GPU (``benchmarks/bench_nf4.py`` times it).

    The tower uses ``ltx_mgpu.text.forward.ATTENTION`` when ``attn_implementation="sdpa"``
    (SDPA that takes the causal kernel whenever a batch has no padding).

    Returns:
        The tower; ``tower.weights`` says what was actually loaded (``"nf4"`` for an artifact).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: unsupported source, quantization or tokenizer (names the supported formats).
        GemmaWeightsError: text-tower weights missing, mis-shaped or unexpected for the config
            (``NF4ArtifactError`` for a damaged artifact).
        ValueError: ``weights`` is neither ``"bf16"`` nor ``"nf4"``; NF4 with a dtype other than
            bf16; ``save_nf4_to`` without ``weights="nf4"`` or with an artifact as source.
    """
    if weights not in ("bf16", "nf4"):
        raise ValueError(f"weights must be 'bf16' or 'nf4', got {weights!r}")
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact":
        if save_nf4_to is not None:
            raise ValueError(f"{p} is already an NF4 artifact; save_nf4_to applies to bf16 sources only")
        from ltx_mgpu.text.nf4 import load_nf4

        tower = load_nf4(p, device, dtype, attn_implementation)
    elif weights == "nf4":
        from ltx_mgpu.text.nf4 import load_nf4_on_the_fly

        tower = load_nf4_on_the_fly(p, device, dtype, attn_implementation, save_to=save_nf4_to)
    elif save_nf4_to is not None:
        raise ValueError("save_nf4_to needs weights='nf4' (it saves the NF4 artifact made while loading)")
    else:
        load = _load_snapshot if fmt == "hf_snapshot" else _load_comfy
        tower = load(p, torch.device(device), dtype, attn_implementation)
    from ltx_mgpu.text.forward import offload_embeddings, use_causal_skip

    use_causal_skip(tower.model)
    nf4_on_gpu = tower.weights == "nf4" and tower.device.type == "cuda"
    if host_embeddings if host_embeddings is not None else nf4_on_gpu:
        offload_embeddings(tower.model)
    if tower.weights == "nf4" and (layer_dequant if layer_dequant is not None else nf4_on_gpu):
        from ltx_mgpu.text.nf4_dequant import FastDequant

        # kept alive by its hooks on the layers. With the Triton kernel the next layer is
        # dequantized on a side stream (a second 449 MB buffer): its launch costs the host
        # almost nothing, and at 1x1024 tokens the eager forward leaves the GPU idle between
        # host-bound launches, where the dequant then runs (H200, head to head with our bf16:
        # 1.224x without the prefetch). bitsandbytes' kernel is host-bound itself: no prefetch
        # (measured no faster: 1x1024 99 vs 92 ms, 8x1024 480 vs 477 ms).
        from ltx_mgpu.text import nf4_triton

        triton = tower.device.type == "cuda" and nf4_triton.available()
        FastDequant(tower.model, method="triton" if triton else "bnb", scope="layer", prefetch=triton)
    return tower
