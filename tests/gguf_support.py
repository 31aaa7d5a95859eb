"""What the packed-weight tests share: the tolerance, the relative error, a tiny LTX-2.3 whose block
linears are whole K-quant blocks wide, its GGUF export in one GGML type or its export in one of
ComfyUI's quantized formats (nvfp4, int8 ± ConvRot), and the float32 file of the values that file
holds (the dense reference of its load)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from sp_harness import build_tiny_model, tiny_config

from ltx_mgpu.assets import comfy_quantized
from ltx_mgpu.assets.ggml_export import block_linear_types, dequantized_copy, export_gguf

REL = 1e-5
#: A tiny model whose block linears are 256 wide (whole K-quant blocks) with 64-wide heads.
WIDE = {"num_attention_heads": 4, "attention_head_dim": 64, "cross_attention_dim": 256,
        "audio_num_attention_heads": 4, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 256}
#: 45 video tokens, 7 audio tokens (``sp_harness``'s case form) at the wide model's context widths.
AV_ODD_CASE = dict(name="av_odd", frames=3, height=3, width=5, audio_tokens=7, context_widths=(256, 256))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius, float32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def wide_file(directory: Path, version: str = "2.3") -> Path:
    """The wide tiny model as a float32 transformer-only file (no connectors) in ``directory``, in
    the LTX-2.3 layout or the 2.0 one (the caption projection in the DiT, 256 wide)."""
    overrides = dict(WIDE)
    if version == "2.0":
        overrides.update(caption_proj_before_connector=False, caption_channels=256)
    path = Path(directory) / f"wide{version.replace('.', '')}_f32.safetensors"
    if not path.exists():
        model = build_tiny_model(**overrides)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
                  metadata={"config": json.dumps(tiny_config(**overrides))})
    return path


def gguf_pair(src: Path, directory: Path, qtype: str) -> tuple[Path, Path]:
    """``src`` exported as GGUF with its block linears in ``qtype``, and the float32 file of the
    values that GGUF file holds: ``(gguf, reference)`` in ``directory``."""
    directory = Path(directory)
    gguf_path = export_gguf(src, directory / f"{Path(src).stem}-{qtype}.gguf", block_linear_types(qtype))
    return gguf_path, dequantized_copy(gguf_path, directory / f"{Path(src).stem}-{qtype}-reference.safetensors")


def comfy_quant_pair(src: Path, directory: Path, fmt: str) -> tuple[Path, Path]:
    """``src`` exported with its block linears in ComfyUI's ``fmt`` (``comfy_quantized.FORMATS``:
    nvfp4, int8, int8_convrot, fp8), and the float32 file of the values it holds."""
    directory = Path(directory)
    path = comfy_quantized.export_comfy_quant(src, directory / f"{Path(src).stem}-{fmt}.safetensors",
                                           comfy_quantized.block_linear_formats(fmt))
    return path, comfy_quantized.dequantized_copy(path, directory / f"{Path(src).stem}-{fmt}-reference.safetensors")


def packed_pair(src: Path, directory: Path, kind: str) -> tuple[Path, Path]:
    """:func:`gguf_pair` for a GGML type (``Q4_K``...), :func:`comfy_quant_pair` for a ComfyUI format."""
    return (comfy_quant_pair if kind in comfy_quantized.FORMATS else gguf_pair)(src, directory, kind)
