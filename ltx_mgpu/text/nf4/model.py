"""The NF4 Gemma 3 text tower as a module tree: the meta-device skeleton and its filling.

:func:`skeleton` builds ``Gemma3TextModel`` without allocating any weight (accelerate's
``init_empty_weights``: parameters on the meta device, buffers real, so the RoPE ``inv_freq``
stay fp32 exactly as transformers computes them) and replaces the projections of
:data:`~ltx_mgpu.text.nf4.artifact.PROJECTIONS` by ``bitsandbytes.nn.Linear4bit`` (NF4, double
quant, compute dtype bf16, generic CPU kernel path). :func:`fill` puts stored tensors in place
(``Params4bit.from_prequantized`` for NF4 weights) and fails listing every parameter left
unfilled, every unexpected tensor and every misfit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import torch

from ltx_mgpu.text.gemma.sources import GemmaWeightsError
from ltx_mgpu.text.nf4.artifact import PROJECTIONS, QUANT_KEYS, QUANT_SETTINGS, NF4ArtifactError

__all__ = ["skeleton", "fill", "nf4_linears", "NF4"]

#: The dtype name of an NF4 parameter in ``expected`` maps and manifests.
NF4 = "nf4"


def skeleton(config: Any, attn_implementation: str = "sdpa") -> tuple[Any, dict[str, tuple[tuple[int, ...], str]]]:
    """A ``Gemma3TextModel`` with every parameter on the meta device (buffers real, RoPE in fp32)
    and its projections replaced by NF4 ``Linear4bit`` (compute dtype bf16, double quant).

    Args:
        config: the ``Gemma3TextConfig`` (not modified; the model gets a copy as ``model.config``).
        attn_implementation: passed to transformers.

    Returns:
        ``(model, expected)``: ``expected`` maps each parameter name, in module order, to
        ``(shape, "nf4" | "bfloat16")`` (the unquantized ``[out, in]`` shape for NF4 weights).
    """
    import bitsandbytes as bnb
    from accelerate import init_empty_weights
    from transformers import Gemma3TextModel

    config = copy.deepcopy(config)  # _from_config sets dtype and attn_implementation on the config it gets
    with init_empty_weights():
        model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    for layer in model.layers:
        for path in PROJECTIONS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            lin = getattr(parent, attr)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
            q.support_avx512bf16_for_cpu = False  # the generic CPU path; see the module docstring
            setattr(parent, attr, q)
    stray = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    if stray:
        raise GemmaWeightsError(f"this Gemma 3 text tower has Linear layers ltx_mgpu does not quantize: {stray}")
    expected = {}
    for name, p in model.named_parameters():
        expected[name] = (tuple(p.shape), NF4 if isinstance(p, bnb.nn.Params4bit) else "bfloat16")
    return model, expected


def nf4_linears(model: torch.nn.Module) -> dict[str, Any]:
    """The ``bitsandbytes.nn.Linear4bit`` modules of a model, by module name."""
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _split_key(key: str) -> tuple[str, str]:
    """``"<p>.weight.absmax"`` -> ``("<p>.weight", "absmax")``; any other key -> ``(key, "")``."""
    for q in QUANT_KEYS:
        if key.endswith(".weight." + q):
            return key[: -len(q) - 1], q
    return key, ""


def _set_module_tensor(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, param)


def fill(model: Any, expected: dict, items: Iterable[tuple[str, torch.Tensor]], device: torch.device,
         where: Path) -> None:
    """Fill the skeleton from ``(stored name, tensor)`` pairs; raise listing every problem.

    Args:
        model, expected: from :func:`skeleton`.
        items: the stored tensors (artifact layout, ``ltx_mgpu.text.nf4.artifact``), any order;
            the pieces of an NF4 weight are held until all six have arrived.
        device: where parameters and buffers go.
        where: the artifact or source, for messages.

    Raises:
        NF4ArtifactError: parameters left unfilled (with the missing NF4 pieces), unexpected
            tensors, shapes or quantization settings that do not match.
    """
    from bitsandbytes.nn import Params4bit

    pending: dict[str, dict[str, torch.Tensor]] = {}
    filled: set[str] = set()
    unexpected: list[str] = []
    wrong: list[str] = []
    for key, t in items:
        param, piece = _split_key(key)
        if param not in expected or (piece and expected[param][1] != NF4) or param in filled:
            unexpected.append(key)
            continue
        shape, kind = expected[param]
        if kind != NF4:
            if tuple(t.shape) != shape:
                wrong.append(f"{key} has shape {tuple(t.shape)}, expected {shape}")
                continue
            _set_module_tensor(model, param, torch.nn.Parameter(t.to(device, torch.bfloat16), requires_grad=False))
            filled.add(param)
            continue
        pieces = pending.setdefault(param, {})
        pieces[piece] = t
        if len(pieces) < len(QUANT_KEYS) + 1:
            continue
        del pending[param]
        module = model.get_submodule(param.rpartition(".")[0])
        try:
            stats = {f"weight.{k}": pieces[k] for k in QUANT_KEYS}
            weight = Params4bit.from_prequantized(pieces[""], stats, device=device, module=module)
        except Exception as exc:  # bitsandbytes raises assorted types for a malformed quant state
            wrong.append(f"{param}: unreadable NF4 quant state ({exc})")
            continue
        qs = weight.quant_state
        got = (qs.quant_type, qs.blocksize, qs.nested, tuple(qs.shape), qs.dtype, weight.numel() * 2)
        want = ("nf4", QUANT_SETTINGS["blocksize"], True, shape, torch.bfloat16, shape[0] * shape[1])
        if got != want:
            wrong.append(f"{param}: NF4 state (quant_type, blocksize, double_quant, shape, dtype, 4-bit values) is "
                         f"{got}, expected {want}")
            continue
        module.weight = weight
        filled.add(param)
    missing = []
    for name in expected:
        if name not in filled:
            have = pending.get(name)
            lacking = [k or "weight" for k in ("", *QUANT_KEYS) if have is not None and k not in have]
            missing.append(f"{name} (NF4 pieces missing: {', '.join(lacking)})" if lacking else name)
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) left unfilled: {', '.join(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) that do not fit: {', '.join(wrong)}")
    if problems:
        raise NF4ArtifactError(f"{where}: the NF4 Gemma 3 weights do not fill the model: " + "; ".join(problems)
                               + ". Re-create the artifact: python -m ltx_mgpu quantize-nf4 SOURCE OUT_DIR")
    for module in model.modules():  # init_empty_weights left the buffers (RoPE, embed scale) on the CPU
        for k, b in module._buffers.items():
            if b is not None:
                module._buffers[k] = b.to(device)
