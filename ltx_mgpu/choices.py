"""The choices a user makes, declared once: every parser, schema, node and config takes them from here.

A leaf module without dependencies (no torch), so ComfyUI's node definitions, the CLI's
argument parser and the wire schemas can all import it cheaply. Each choice is checked where
its one frozen config is built (:class:`ltx_mgpu.text.config.TextEncoderConfig` for the text
encoder, the wire schemas for requests) with :func:`check_choice`.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["WEIGHTS", "PLACEMENTS", "DTYPE_NAMES", "TEXT_DTYPES", "AUTO_DTYPE", "TEXT_COMPUTE_DTYPES",
           "TRANSFORMER_DTYPES", "TRANSFORMER_COMPUTE_DTYPES", "TRANSFORMER_WEIGHTS", "TRANSFORMER_STORAGE",
           "FP8_COMPUTES", "FP8_SCALINGS",
           "SP_LAYOUTS", "ATTENTION_TYPES", "LIFETIMES", "SAMPLERS", "AV_TIMESTEP_CONVENTIONS", "check_choice", "spell"]

#: Gemma 3 weights: ``bf16`` (as stored, upcast from fp16 / fp8) or ``nf4`` (bitsandbytes NF4).
WEIGHTS = ("bf16", "nf4")
#: Where Gemma runs in the pool: rank 0 alone, Accelerate-sharded over every rank, or a replica per
#: rank with the prompts split among them.
PLACEMENTS = ("single", "accelerate", "batch_parallel")
#: The short dtype names users type -> torch's names (the one such table).
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: Gemma's compute dtype, by torch's name (``float32`` for reference runs); the short names of
#: :data:`DTYPE_NAMES` are taken too.
TEXT_DTYPES = ("bfloat16", "float32", "float16")
#: The compute dtype that follows the device Gemma runs on: what ComfyUI's own text encoder computes
#: in there (``ltx_mgpu.text.config.resolve_text_dtype``).
AUTO_DTYPE = "auto"
#: The Gemma Loader's compute dtype choices: :data:`AUTO_DTYPE` (the default), or one of
#: :data:`DTYPE_NAMES`' short names.
TEXT_COMPUTE_DTYPES = (AUTO_DTYPE, "bf16", "fp32", "fp16")
#: The LTX-2 transformer's compute dtype; ``fp8``: the blocks' large linears as e4m3 GEMMs on FP8
#: tensor cores (Ada, Hopper or newer), everything else bf16 (``ltx_mgpu.denoise.fp8``).
TRANSFORMER_DTYPES = ("bf16", "fp16", "fp32", "fp8")
#: The compute dtype (torch's name) of each :data:`TRANSFORMER_DTYPES` choice: what the weights
#: are held in (but the e4m3 ones) and what ComfyUI is told the model computes in.
TRANSFORMER_COMPUTE_DTYPES = {**DTYPE_NAMES, "fp8": "bfloat16"}
#: Whether the pool compiles the LTX-2 transformer's blocks (``torch.compile``, one graph per token
#: bucket; ``ltx_mgpu.denoise.fp8.compile_blocks``): ``auto`` compiles them for dtype ``fp8`` (its
#: e4m3 quantization is fused by the compile) and runs every other dtype eagerly, as ComfyUI's own
#: model runs; ``on`` compiles them for every dtype (faster per step; the first call at a size
#: compiles first, and the result differs from eager's by bf16 rounding).
TRANSFORMER_COMPILE = ("auto", "on")
#: How the pool holds the LTX-2 transformer: a whole copy on every rank, or each rank a 1/N shard
#: of every weight, gathered block by block as it runs (FSDP2; ``ltx_mgpu.denoise.parallel.fsdp``).
TRANSFORMER_WEIGHTS = ("replicated", "sharded")
#: How a checkpoint stores the transformer blocks' linears: as its dense dtype, as float8 e4m3
#: (an fp8 file), as GGML blocks (a GGUF file) or as ComfyUI's nvfp4 / int8 layers (a file with
#: ``comfy_quant`` markers: ``fp4_mixed``, ``int8_convrot``...); read from its header.
TRANSFORMER_STORAGE = ("dense", "e4m3", "ggml", "comfy_quant")
#: How an fp8 layer computes (``ltx_mgpu.denoise.fp8``): an upcast weight, or an e4m3 GEMM.
FP8_COMPUTES = ("upcast", "fp8")
#: The scale granularity of an e4m3 GEMM: a scale per token and per output channel, or one per tensor.
FP8_SCALINGS = ("row", "tensor")
#: How a model call is split over the pool's ranks (``ltx_mgpu.denoise.parallel.layout``): ``auto``
#: (the batch's guidance passes over gcd(batch, ranks) groups of ranks, each Ulysses over its ranks;
#: Ulysses when that is one group), ``ulysses`` (the video tokens over all ranks) or ``cfg_ulysses``
#: (any batch of two or more on two halves of the pool).
SP_LAYOUTS = ("auto", "ulysses", "cfg_ulysses")
#: The transformer's attention backends: ltx-core 1.0.0's (``AttentionFunction``'s values) and
#: ``triton_8bit``, our 8-bit Triton flash attention (int8 Q K^T, e4m3 P V; Hopper or newer;
#: ``ltx_mgpu.denoise.attention``).
ATTENTION_TYPES = ("default", "pytorch", "xformers", "flash_attention_3", "triton_8bit")
#: How long a started pool lives: until the process that started it exits, or until stopped.
LIFETIMES = ("with-owner", "detached")
#: The samplers of the in-pool SP Sampler (``ltx_mgpu.denoise.comfyui.sampler``).
SAMPLERS = ("euler",)
#: How the MODEL path feeds LTX-2's audio-video cross-attention AdaLNs: ``"scaled"`` (sigma x 1000,
#: as ltx-core and ComfyUI after Comfy-Org/ComfyUI#14097) or ``"raw"`` (the sigma, as ComfyUI up
#: to 0.20.1), to equal the installed ComfyUI's own model.
AV_TIMESTEP_CONVENTIONS = ("scaled", "raw")


def check_choice(value: Any, choices: Sequence[str], what: str) -> str:
    """``value`` when it is one of ``choices``.

    Raises:
        ValueError: ``"<what> must be one of 'a', 'b' or 'c', got <value>"``.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what} must be one of {spell(choices)}, got {value!r}")
    return value


def spell(choices: Sequence[str]) -> str:
    """``"'a', 'b' or 'c'"``: choices as a message names them."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
