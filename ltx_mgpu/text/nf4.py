"""NF4 Gemma 3 text tower (bitsandbytes): quantize to an artifact, load it, or quantize on load.

Settings (always; :data:`QUANT_SETTINGS`): bitsandbytes NF4 (NormalFloat-4, QLoRA, arXiv:2305.14314),
blocksize 64, double quantization (block scales 8-bit quantized in blocks of 256 around their
mean), compute dtype **bf16**: bitsandbytes' default compute dtype is fp32 (slow), and fp16
gives empty output for Gemma 3 (bitsandbytes issue #1572); the fp32 default is transformers'
``BitsAndBytesConfig`` (``utils/quantization_config.py``).
The 7 projections of every decoder layer (:data:`PROJECTIONS`, ~91 % of Gemma 3 12B's text
parameters) are NF4; the embedding and the RMSNorm weights stay bf16; vision tower, projector
and ``lm_head`` (tied to the embedding) are neither read nor stored.

Three ways in, one result:

* :func:`quantize_nf4` streams a bf16/fp16/fp8 source into an artifact directory
  (``ltx_mgpu.text.nf4_artifact`` describes the format), quantizing each tensor on ``device``;
* :func:`load_nf4` builds the ``Gemma3TextModel`` skeleton on the meta device, swaps the
  projections for ``bitsandbytes.nn.Linear4bit`` and fills it from the artifact
  (``Params4bit.from_prequantized``), failing with the list of every parameter left unfilled;
* :func:`load_nf4_on_the_fly` quantizes a bf16 source straight into the model with the same
  code, so its tensors are the same bytes as quantize-then-load on the same device; it can
  save the artifact (``save_to``) before any forward.

CPU kernel path: every ``Linear4bit`` gets ``support_avx512bf16_for_cpu = False``. On
AVX512-BF16 CPUs bitsandbytes otherwise repacks the weights on the first forward, and its
inverse (run by ``state_dict``, ``.cuda()``) is lossy: a save after a forward is corrupted
(bitsandbytes #2078); the results also depend on the CPU. The generic path (dequantize, then
``F.linear``) is the same on every CPU, and was the faster one on Gemma 3 270M (2.28 s vs
3.15 s, 2 prompts x 1024 tokens on 2 threads). GPUs are unaffected.

After loading, a probe prompt is encoded and any non-finite hidden state is an error.

Fidelity on the real Gemma 3 270M (tests/test_nf4.py; mean per-token cosine NF4 vs bf16): >= 0.992
for every decoder layer's output, 0.961 for the final post-RMSNorm state (its gains amplify the
last layer's error; an earlier CPU run found 0.960), 0.995 for the LTX-2.3 feature extractor's
output.
Prefill speed-ups over bitsandbytes' per-Linear path live in ``ltx_mgpu.text.nf4_dequant``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from ltx_mgpu.text.gemma import GemmaTextTower, encode_hidden_states
from ltx_mgpu.text.gemma_sources import GemmaWeightsError, find_tokenizer_files, gemma_identity, gemma_source_files
from ltx_mgpu.text.nf4_artifact import (
    PROJECTIONS,
    QUANT_SETTINGS,
    NF4ArtifactError,
    check_artifact_files,
    iter_artifact_tensors,
    read_manifest,
    write_artifact,
)
from ltx_mgpu.text.nf4_model import NF4, fill, nf4_linears, skeleton
from ltx_mgpu.text.nf4_source import GemmaSource, iter_source, open_source

__all__ = [
    "PROJECTIONS",
    "QUANT_SETTINGS",
    "PROBE_PROMPT",
    "NF4ArtifactError",
    "NonFiniteHiddenStatesError",
    "quantize_nf4",
    "quantize_nf4_model",
    "load_nf4",
    "load_nf4_on_the_fly",
    "save_nf4",
    "check_finite_hidden_states",
    "nf4_linears",
]

log = logging.getLogger(__name__)

#: Encoded after every NF4 load; any non-finite hidden state fails the load.
PROBE_PROMPT = "A red fox runs through fresh snow at dawn, the camera slowly tracking it."


class NonFiniteHiddenStatesError(GemmaWeightsError):
    """The NF4 tower produced NaN/inf hidden states for the probe prompt."""


# --------------------------------------------------------------------------- quantize


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def _quantize(name: str, w: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """NF4 of one ``[N, K]`` weight on ``device``: the weight is cast to bf16 first (the
    quantized state then dequantizes to bf16), then ``bitsandbytes.functional.quantize_4bit``.

    Returns:
        ``{name: packed uint8 [N*K/2, 1], name + ".absmax": ..., ...}`` on ``device``
        (the keys of :data:`~ltx_mgpu.text.nf4_artifact.QUANT_KEYS`).
    """
    import bitsandbytes.functional as bf

    w = w.to(device).to(torch.bfloat16).contiguous()
    packed, qs = bf.quantize_4bit(w, blocksize=QUANT_SETTINGS["blocksize"], compress_statistics=True,
                                  quant_type="nf4", quant_storage=torch.uint8)
    return {name: packed, **{f"{name}.{k}": v for k, v in qs.as_dict(packed=True).items()}}


def _source_groups(src: GemmaSource, expected: dict, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The source's parameters in module order, each as the tensors stored for it, on ``device``."""
    for name, t in iter_source(src, list(expected)):
        if expected[name][1] == NF4:
            yield _quantize(name, t, device)
        else:
            yield {name: t.to(device).to(torch.bfloat16)}


def _check_source(src: GemmaSource, expected: dict) -> None:
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
        source: HF snapshot directory or ComfyUI single file (bf16, fp16 or fp8 weights).
        out_dir: the artifact directory to create (must not exist).
        device: where to quantize (default: CUDA if available, else CPU).
        shard_bytes: target size of each ``nf4-NNNNN.safetensors`` shard (bytes).

    Returns:
        ``out_dir``. Its manifest records the source's :func:`gemma_identity`, format and file
        name, the library versions, :data:`QUANT_SETTINGS` and the device type, the text config,
        every parameter with its shape and dtype (``"nf4"`` or ``"bfloat16"``), every shard
        with its size and tensors, and the tokenizer files.

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
    _check_source(src, expected)
    info = {"format": src.format, "name": src.path.name, "identity": gemma_identity(src.path)}
    return write_artifact(Path(out_dir), _source_groups(src, expected, dev), src.config, expected, info,
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

    groups = (_quantize(n, params[n].data, dev) if kind == NF4 else {n: params[n].data.to(torch.bfloat16)}
              for n, (_, kind) in expected.items())
    info = {"format": "in_memory", "name": name, "identity": None}
    return write_artifact(Path(out_dir), groups, model.config, expected, info, write_tokenizer, dev, shard_bytes)


# --------------------------------------------------------------------------- load


def check_finite_hidden_states(tower: GemmaTextTower, prompt: str = PROBE_PROMPT) -> None:
    """Encode ``prompt`` and raise if any hidden state is NaN or infinite at a real token.

    Raises:
        NonFiniteHiddenStatesError: names the hidden-state indices (0 = embedding output).
    """
    from ltx_mgpu.text.tokenizer import tokenize

    ids, mask, _ = tokenize(tower, [prompt])
    hidden = encode_hidden_states(tower, ids, mask)
    keep = mask.bool().to(hidden[0].device)
    bad = [i for i, h in enumerate(hidden) if not torch.isfinite(h[keep]).all()]
    if bad:
        raise NonFiniteHiddenStatesError(
            f"{tower.path}: the NF4 Gemma 3 gives non-finite hidden states for a probe prompt at index(es) {bad} "
            "(0 = embeddings). The weights are damaged or were not computed in bf16; re-create the artifact from a "
            "bf16 source: python -m ltx_mgpu quantize-nf4 SOURCE OUT_DIR"
        )


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16:
        raise ValueError(
            f"NF4 Gemma 3 always computes in bfloat16, got dtype={dtype}: fp32 is bitsandbytes' slow default and "
            "fp16 gives empty output for Gemma 3 (bitsandbytes #1572). Pass dtype=torch.bfloat16 (--dtype bfloat16)."
        )


def load_nf4(artifact_dir: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
             attn_implementation: str = "sdpa", *, probe: bool = True) -> GemmaTextTower:
    """Load an NF4 artifact (made by :func:`quantize_nf4`) as a Gemma 3 text tower.

    No full-precision weight is ever allocated: the skeleton is built on the meta device and
    each stored tensor is read by safetensors straight onto ``device``.

    Args:
        artifact_dir: the artifact directory.
        device: where the model runs (``"cpu"``, ``"cuda:0"``, ...).
        dtype: must be ``torch.bfloat16`` (the compute and resident dtype).
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        probe: encode :data:`PROBE_PROMPT` and fail on non-finite hidden states.

    Returns:
        A ``GemmaTextTower`` with ``format="nf4_artifact"``, ``weights="nf4"``; its identity is
        the digest of the artifact's files.

    Raises:
        NF4ArtifactError: damaged or incomplete artifact; lists every unfilled parameter and
            every unexpected tensor.
        NonFiniteHiddenStatesError: the probe prompt gives NaN/inf.
        ValueError: ``dtype`` is not bf16.
    """
    from transformers import Gemma3TextConfig

    from ltx_mgpu.text.tokenizer import check_tokenizer, load_tokenizer

    _check_dtype(dtype)
    d = Path(artifact_dir)
    manifest = read_manifest(d)
    quant = {k: manifest["quantization"].get(k) for k in QUANT_SETTINGS}
    if quant != QUANT_SETTINGS:
        raise NF4ArtifactError(f"{d}: quantization settings {quant} differ from ltx_mgpu's {QUANT_SETTINGS}; "
                               "re-create the artifact: python -m ltx_mgpu quantize-nf4 SOURCE OUT_DIR")
    check_artifact_files(d, manifest)
    config = Gemma3TextConfig.from_dict(manifest["config"])
    model, expected = skeleton(config, attn_implementation)
    listed = {n: (tuple(v["shape"]), v["dtype"]) for n, v in manifest["parameters"].items()}
    if listed != expected:
        diff = sorted(set(listed.items()) ^ set(expected.items()))
        raise NF4ArtifactError(f"{d}: the manifest's parameter list does not match the Gemma 3 model built from its "
                               f"config (differences: {diff[:20]}); re-create the artifact with this ltx_mgpu")
    dev = torch.device(device)
    fill(model, expected, iter_artifact_tensors(d, manifest, dev), dev, d)
    found = find_tokenizer_files(d, prefer_spm=manifest["tokenizer"].get("kind") == "sentencepiece")
    if found is None:
        raise NF4ArtifactError(f"{d}: the tokenizer files {manifest['tokenizer'].get('files')} are missing; "
                               "re-create the artifact: python -m ltx_mgpu quantize-nf4 SOURCE OUT_DIR")
    tokenizer = check_tokenizer(load_tokenizer(found), d)
    tower = GemmaTextTower(model.eval(), tokenizer, model.config, "nf4_artifact", d, gemma_source_files(d), weights="nf4")
    if probe:
        check_finite_hidden_states(tower)
    return tower


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
        info = {"format": src.format, "name": src.path.name, "identity": tower.identity}
        write_tokenizer = src.write_tokenizer
    return write_artifact(Path(out_dir), groups(), tower.config, expected, info, write_tokenizer, device,
                          shard_bytes)


def load_nf4_on_the_fly(source: str | os.PathLike, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.bfloat16, attn_implementation: str = "sdpa", *,
                        save_to: str | os.PathLike | None = None, probe: bool = True) -> GemmaTextTower:
    """Quantize a bf16/fp16/fp8 Gemma 3 source to NF4 while loading it (no artifact needed).

    The same streaming and quantization as :func:`quantize_nf4`, into the model instead of
    files: on the same device type the quantized tensors are byte-identical to quantize-then-
    :func:`load_nf4`. Peak device memory is the NF4 model plus one bf16 tensor.

    Args:
        source: HF snapshot directory or ComfyUI single file.
        device, dtype, attn_implementation, probe: as :func:`load_nf4`.
        save_to: also write the artifact there (before any forward), to load next time.

    Returns:
        A ``GemmaTextTower`` with the source's ``format``, ``weights="nf4"`` and the source's
        identity.

    Raises:
        As :func:`quantize_nf4` and :func:`load_nf4`.
    """
    _check_dtype(dtype)
    src = open_source(source)
    dev = torch.device(device)
    model, expected = skeleton(src.config, attn_implementation)
    _check_source(src, expected)
    items = ((k, t) for group in _source_groups(src, expected, dev) for k, t in group.items())
    fill(model, expected, items, dev, src.path)
    tower = GemmaTextTower(model.eval(), src.tokenizer(), model.config, src.format, src.path,
                           gemma_source_files(src.path), weights="nf4")
    if save_to is not None:
        save_nf4(tower, save_to)
        log.info("saved the NF4 artifact of %s to %s", src.path, save_to)
    if probe:
        check_finite_hidden_states(tower)
    return tower
