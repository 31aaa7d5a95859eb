"""Quantize a Gemma 3 text tower to NF4 (bitsandbytes) and write it as an artifact directory.

Settings (always; :data:`~ltx_mgpu.text.nf4.artifact.QUANT_SETTINGS`): bitsandbytes NF4
(NormalFloat-4, QLoRA, arXiv:2305.14314), blocksize 64, double quantization (block scales 8-bit
quantized in blocks of 256 around their mean), compute dtype **bf16**: bitsandbytes' default
compute dtype is fp32 (slow), and fp16 gives empty output for Gemma 3 (bitsandbytes issue
#1572); the fp32 default is transformers' ``BitsAndBytesConfig`` (``utils/quantization_config.py``).
The 7 projections of every decoder layer (:data:`~ltx_mgpu.text.nf4.artifact.PROJECTIONS`,
~91 % of Gemma 3 12B's text parameters) are NF4; the embedding and the RMSNorm weights stay
bf16; vision tower, projector and ``lm_head`` (tied to the embedding) are neither read nor stored.

* :func:`quantize_nf4` streams a bf16/fp16/fp8 source into an artifact directory
  (:mod:`ltx_mgpu.text.nf4.artifact` describes the format), quantizing each tensor on ``device``;
* :func:`quantize_nf4_model` does the same for an in-memory bf16 model;
* :func:`save_nf4` writes a loaded NF4 tower (:mod:`ltx_mgpu.text.nf4.load`) as an artifact.

Loading an artifact, or quantizing a source while loading it, is :mod:`ltx_mgpu.text.nf4.load`'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from ltx_mgpu.text.gemma.sources import GemmaWeightsError, find_tokenizer_files, gemma_identity
from ltx_mgpu.text.gemma.tower import GemmaTextTower
from ltx_mgpu.text.nf4.artifact import QUANT_SETTINGS, read_manifest, write_artifact
from ltx_mgpu.text.nf4.model import NF4, skeleton
from ltx_mgpu.text.nf4.source import GemmaSource, iter_source, open_source

__all__ = ["quantize_nf4", "quantize_nf4_model", "save_nf4", "quantize_tensor", "source_groups", "check_source"]


# --------------------------------------------------------------------------- quantize


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def quantize_tensor(name: str, w: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """NF4 of one ``[N, K]`` weight on ``device``: the weight is cast to bf16 first (the
    quantized state then dequantizes to bf16), then ``bitsandbytes.functional.quantize_4bit``.

    Returns:
        ``{name: packed uint8 [N*K/2, 1], name + ".absmax": ..., ...}`` on ``device``
        (the keys of :data:`~ltx_mgpu.text.nf4.artifact.QUANT_KEYS`).
    """
    import bitsandbytes.functional as bf

    w = w.to(device).to(torch.bfloat16).contiguous()
    packed, qs = bf.quantize_4bit(w, blocksize=QUANT_SETTINGS["blocksize"], compress_statistics=True,
                                  quant_type="nf4", quant_storage=torch.uint8)
    return {name: packed, **{f"{name}.{k}": v for k, v in qs.as_dict(packed=True).items()}}


def source_groups(src: GemmaSource, expected: dict, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The source's parameters in module order, each as the tensors stored for it, on ``device``."""
    for name, t in iter_source(src, list(expected), device):
        if expected[name][1] == NF4:
            yield quantize_tensor(name, t, device)
        else:
            yield {name: t.to(device).to(torch.bfloat16)}


def check_source(src: GemmaSource, expected: dict) -> None:
    """Compare the source's headers with the skeleton before reading any weight."""
    missing = [n for n in expected if n not in src.shapes]
    stray = sorted(n for n in src.shapes if n not in expected)
    wrong = [f"{n}: {src.shapes[n]} vs {expected[n][0]}" for n in expected
             if n in src.shapes and tuple(src.shapes[n]) != expected[n][0]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing text-tower weight(s): {missing}")
    if wrong:
        problems.append(f"{len(wrong)} weight(s) with a shape not matching the config: {wrong}")
    if stray:
        problems.append(f"{len(stray)} text-tower weight(s) the config has no place for: {stray}")
    if problems:
        raise GemmaWeightsError(f"{src.path}: the Gemma 3 text-tower weights do not match the config: "
                                + "; ".join(problems) + ". The source is incomplete or belongs to another model.")


def quantize_nf4(source: str | os.PathLike, out_dir: str | os.PathLike, device: str | torch.device | None = None,
                 *, shard_bytes: int = 1 << 30) -> Path:
    """Stream a Gemma 3 text tower into an NF4 artifact directory.

    Each text-tower tensor is read alone from the source (``safe_open`` per tensor: host RAM
    holds one source tensor plus the pending output shard, never the bf16 model), moved to
    ``device``, cast to bf16, and NF4-quantized there (quantize on the device that will run
    it: bitsandbytes' CPU and CUDA quantizers are different kernels, and the double-quant offset
    is a mean whose last bits depend on the reduction order, so their bytes may differ).
    The directory is built under a temporary sibling name with the manifest written last and
    renamed into place at the end: an interrupted run leaves no manifest, and is never
    detected as an artifact.

    Args:
        source: HF snapshot directory or ComfyUI single file (bf16, fp16 or fp32 weights, or
            ComfyUI's quantized layers, dequantized on ``device`` first).
        out_dir: the artifact directory to create (must not exist).
        device: where to quantize (default: CUDA if available, else CPU).
        shard_bytes: target size of each ``nf4-NNNNN.safetensors`` shard (bytes).

    Returns:
        ``out_dir``. Its manifest records the source's :func:`gemma_identity` (which covers how
        a quantized ComfyUI file is decoded), format, file name and the quantized formats it
        stores (``stored_as``, e.g. ``"float8_e4m3fn,nvfp4"``; absent for plain weights), the library versions,
        :data:`QUANT_SETTINGS` and the device type, the text config, every parameter with its
        shape and dtype (``"nf4"`` or ``"bfloat16"``), every shard with its size and tensors, and
        the tokenizer files.

    Raises:
        FileNotFoundError, GemmaFormatError: as ``detect_gemma_format``; an NF4 artifact as source.
        GemmaWeightsError: source weights missing, mis-shaped or unexpected (all listed).
        FileExistsError: ``out_dir`` exists.
    """
    if Path(out_dir).exists():
        raise FileExistsError(f"{out_dir} already exists; pass a new directory (or delete it first)")
    src = open_source(source)
    dev = _resolve_device(device)
    _, expected = skeleton(src.config)
    check_source(src, expected)
    info = {"format": src.format, "name": src.path.name, "identity": gemma_identity(src.path),
            **({"stored_as": src.stored_as} if src.stored_as else {})}
    return write_artifact(Path(out_dir), source_groups(src, expected, dev), src.config, expected, info,
                          src.write_tokenizer, dev, shard_bytes)


def quantize_nf4_model(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                       device: str | torch.device | None = None, *, name: str = "in-memory",
                       shard_bytes: int = 1 << 30) -> Path:
    """Quantize an in-memory bf16 ``Gemma3TextModel`` (e.g. random weights from a config, as the
    benchmarks build) into an artifact, tensor by tensor, exactly as :func:`quantize_nf4` does
    for files.

    Args:
        model: a plain ``Gemma3TextModel`` (no quantized layers).
        out_dir: the artifact directory to create.
        tokenizer_dir: a directory with Gemma tokenizer files to copy in.
        device: where to quantize (default: the model's device).
        name: recorded as the source name; the recorded identity is ``None`` (no source files).

    Raises:
        GemmaWeightsError: the model's parameters do not match a Gemma 3 text tower of its config.
        FileExistsError: ``out_dir`` exists.
    """
    params = dict(model.named_parameters())
    dev = torch.device(device) if device is not None else next(iter(params.values())).device
    _, expected = skeleton(model.config)
    if {n: tuple(p.shape) for n, p in params.items()} != {n: s for n, (s, _) in expected.items()}:
        raise GemmaWeightsError(f"{name}: the model's parameters are not those of a Gemma 3 text tower of its config")
    found = find_tokenizer_files(Path(tokenizer_dir))
    if found is None:
        raise GemmaWeightsError(f"{tokenizer_dir}: no tokenizer.json or tokenizer.model to copy into the artifact")

    def write_tokenizer(directory: Path) -> dict:
        for f in found.files:
            shutil.copyfile(f, directory / f.name)
        return {"kind": found.kind, "files": sorted(f.name for f in found.files)}

    groups = (quantize_tensor(n, params[n].data, dev) if kind == NF4 else {n: params[n].data.to(torch.bfloat16)}
              for n, (_, kind) in expected.items())
    info = {"format": "in_memory", "name": name, "identity": None}
    return write_artifact(Path(out_dir), groups, model.config, expected, info, write_tokenizer, dev, shard_bytes)


def save_nf4(tower: GemmaTextTower, out_dir: str | os.PathLike, *, shard_bytes: int = 1 << 30) -> Path:
    """Write an NF4 tower (from :func:`load_nf4` or :func:`load_nf4_on_the_fly`) as an artifact.

    The tensors are taken from the ``Linear4bit`` quant states directly (not through
    ``state_dict``, whose CPU repack inverse is lossy), in module order, so saving the tower
    made on the fly gives the same bytes as :func:`quantize_nf4` of its source on the same
    device type, before or after forwards.

    Raises:
        ValueError: ``tower`` is not NF4, or a weight is in bitsandbytes' AVX512-BF16 packed
            CPU layout (its inverse is lossy).
        FileExistsError: ``out_dir`` exists.
    """
    from bitsandbytes.nn import Params4bit

    if tower.weights != NF4:
        raise ValueError(f"{tower.path}: save_nf4 needs an NF4 tower (weights='nf4'), got weights={tower.weights!r}")
    _, expected = skeleton(tower.config)
    params = dict(tower.model.named_parameters())
    device = tower.device  # where the layers were quantized (the embedding table may be in host memory)

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        for name in expected:
            p = params[name]
            if not isinstance(p, Params4bit):
                yield {name: p.data}
                continue
            if getattr(p.quant_state, "packing_format_for_cpu", False):
                raise ValueError(f"{name} was repacked for bitsandbytes' AVX512-BF16 CPU kernel, whose inverse is "
                                 "lossy; load the tower with ltx_mgpu (which keeps the generic CPU path) and save it")
            yield {name: p.data, **{f"{name}.{k}": v for k, v in p.quant_state.as_dict(packed=True).items()}}

    if tower.format == "nf4_artifact":
        manifest = read_manifest(Path(tower.path))
        info, tok_files = manifest["source"], manifest["tokenizer"]

        def write_tokenizer(directory: Path) -> dict:
            for name in tok_files["files"]:
                shutil.copyfile(Path(tower.path) / name, directory / name)
            return tok_files
    else:
        src = open_source(tower.path)
        info = {"format": src.format, "name": src.path.name, "identity": tower.identity,
                **({"stored_as": src.stored_as} if src.stored_as else {})}
        write_tokenizer = src.write_tokenizer
    return write_artifact(Path(out_dir), groups(), tower.config, expected, info, write_tokenizer, device,
                          shard_bytes)
