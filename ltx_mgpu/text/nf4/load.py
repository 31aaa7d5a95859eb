"""Load an NF4 Gemma 3 text tower: from an artifact directory, or by quantizing a source on load.

* :func:`load_nf4` builds the ``Gemma3TextModel`` skeleton on the meta device, swaps the
  projections for ``bitsandbytes.nn.Linear4bit`` and fills it from the artifact
  (``Params4bit.from_prequantized``), failing with the list of every parameter left unfilled;
* :func:`load_nf4_on_the_fly` quantizes a bf16 source straight into the model with
  :mod:`ltx_mgpu.text.nf4.quantize`'s code, so its tensors are the same bytes as
  quantize-then-load on the same device; it can save the artifact (``save_to``) before any forward.

CPU kernel path: every ``Linear4bit`` gets ``support_avx512bf16_for_cpu = False``. On
AVX512-BF16 CPUs bitsandbytes otherwise repacks the weights on the first forward, and its
inverse (run by ``state_dict``, ``.cuda()``) is lossy: a save after a forward is corrupted
(bitsandbytes #2078); the results also depend on the CPU. The generic path (dequantize, then
``F.linear``) is the same on every CPU.

After loading, a probe prompt is encoded and any non-finite hidden state is an error. NF4's
fidelity to bf16 on the real Gemma 3 270M is tested in ``tests/integration/test_gemma_270m.py``; the faster
prefill kernels are :mod:`ltx_mgpu.text.nf4.dequant`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ltx_mgpu.text.gemma.forward import encode_hidden_states
from ltx_mgpu.text.gemma.sources import GemmaWeightsError, find_tokenizer_files, gemma_source_files
from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, load_tokenizer, tokenize
from ltx_mgpu.text.gemma.tower import GemmaTextTower
from ltx_mgpu.text.nf4.artifact import (
    QUANT_SETTINGS,
    NF4ArtifactError,
    check_artifact_files,
    iter_artifact_tensors,
    read_manifest,
)
from ltx_mgpu.text.nf4.model import fill, skeleton
from ltx_mgpu.text.nf4.quantize import check_source, save_nf4, source_groups
from ltx_mgpu.text.nf4.source import open_source

__all__ = ["PROBE_PROMPT", "NonFiniteHiddenStatesError", "check_finite_hidden_states", "load_nf4",
           "load_nf4_on_the_fly"]

log = logging.getLogger(__name__)

#: Encoded after every NF4 load; any non-finite hidden state fails the load.
PROBE_PROMPT = "A red fox runs through fresh snow at dawn, the camera slowly tracking it."


class NonFiniteHiddenStatesError(GemmaWeightsError):
    """The NF4 tower produced NaN/inf hidden states for the probe prompt."""


def check_finite_hidden_states(tower: GemmaTextTower, prompt: str = PROBE_PROMPT) -> None:
    """Encode ``prompt`` and raise if any hidden state is NaN or infinite at a real token.

    Raises:
        NonFiniteHiddenStatesError: names the hidden-state indices (0 = embedding output).
    """
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
    tower = GemmaTextTower(model.eval(), tokenizer, model.config, "nf4_artifact", d, gemma_source_files(d),
                           weights="nf4")
    if probe:
        check_finite_hidden_states(tower)
    return tower


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
    check_source(src, expected)
    items = ((k, t) for group in source_groups(src, expected, dev) for k, t in group.items())
    fill(model, expected, items, dev, src.path)
    tower = GemmaTextTower(model.eval(), src.tokenizer(), model.config, src.format, src.path,
                           gemma_source_files(src.path), weights="nf4")
    if save_to is not None:
        save_nf4(tower, save_to)
        log.info("saved the NF4 artifact of %s to %s", src.path, save_to)
    if probe:
        check_finite_hidden_states(tower)
    return tower
