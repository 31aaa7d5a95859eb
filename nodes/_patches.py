"""ComfyUI's model patches on the pool MODEL: each honoured as ComfyUI's own LTX-2 model honours
it, or refused by the name of the node that made it.

ComfyUI's MODEL -> MODEL nodes change a MODEL (``comfy.model_patcher.ModelPatcher``) in a few
ways; on the pack's MODEL (:mod:`nodes._model`, whose transformer runs in the pool) each is
treated as ComfyUI 0.20.1's own LTX-2 model treats it (``comfy/ldm/lightricks/av_model.py``,
``model.py``):

* **sampler-level** patches (cfg / pre- and post-cfg functions, model sampling, denoise-mask
  functions, the sampling wrappers, ``model_function_wrapper``) run in ComfyUI's process around
  the model calls, for our MODEL as for ComfyUI's: nothing to do here.
* **weight patches** (``add_patches``: the LoRA loaders, the attention multipliers' scale-only
  ``(None,)`` patches) are merged in the pool (:mod:`ltx_mgpu.client.model`).
* **bypass LoRAs** (``LoraLoaderBypass``, ``LoraModelLoader`` with ``bypass``): ComfyUI hooks
  the layers' forward to add ``s * up(down(x))``; for a linear layer that is ``(W + s * up @
  down) x``, so :func:`bypass_patches` turns the injected hooks into LoRA patches merged in the
  pool after the weight patches (float32, equal up to rounding).
* ``DIFFUSION_MODEL`` **wrappers** (``EasyCache``) run around the pool call as ComfyUI runs them
  around its model's ``_forward`` (a wrapper that returns a cached result skips the pool call).
* **block replacements** ``patches_replace["dit"][("double_block", i)]`` that return their input
  (the skip-layer guidance nodes) skip block ``i`` in the pool (:func:`call_plan`; ComfyUI's
  LTX-2 model passes the block's hidden states through unchanged); any other block replacement
  is refused.
* what ComfyUI's LTX-2 model **does not read** (``transformer_options["patches"]``: attention,
  U-Net block and input patches; ``patches_replace`` other than the ``dit`` double blocks:
  attention replacements such as PAG's and SAG's) changes nothing there, so it changes nothing
  here either; the log says so once per node.
* **refused**, naming the node and what to use instead, before the first model call: attention
  overrides (``optimized_attention_override``), LTX-2's branch switches
  (``run_vx``/``run_ax``/``a2v_cross_attn``/``v2a_cross_attn`` off), weight wrappers, module
  injections other than the bypass LoRAs', conditioning hooks, a compute dtype other than the
  pool's (``ModelComputeDtype``), merges and saves (the weights live in the pool).

Which node made a patch is read from its function's ``__qualname__`` (``SkipLayerGuidanceDiT.
execute.<locals>.skip``) or, for a node running now, from the call stack, mapped to ComfyUI's
node id through ``nodes.NODE_CLASS_MAPPINGS``. ``TorchCompileModel`` compiles nothing of ours
(the transformer runs in the pool, whose own compilation the Model Loader's ``compile: on`` or
``dtype: fp8`` turns on); the log says so once.

Needs ComfyUI loaded in this process for everything but the plain helpers.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ltx_mgpu.client.errors import BadInputError

from . import _comfy

__all__ = ["BRANCH_SWITCHES", "BYPASS_INJECTIONS", "ModelPatchRefused", "bypass_patches", "call_plan", "caller_node",
           "check_sampling", "compute_dtype_refusal", "patch_node", "refuse"]

LOG = logging.getLogger("ltx_mgpu")
#: ``transformer_options`` switches ComfyUI's LTX-2 blocks read (``BasicAVTransformerBlock.forward``);
#: the pool runs every branch, so one set to False is refused.
BRANCH_SWITCHES = ("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")
#: The key of ComfyUI's bypass LoRA injections (``comfy.sd.load_bypass_lora_for_models``).
BYPASS_INJECTIONS = "bypass_lora"
#: The ``patches_replace`` entries ComfyUI's LTX-2 model reads: the ``dit`` double blocks.
_READ = ("dit", "double_block")
_said: set[str] = set()


class ModelPatchRefused(BadInputError):
    """A ComfyUI model patch the pool MODEL does not run (names the node and what to use instead)."""


def refuse(node: str, what: str, instead: str) -> ModelPatchRefused:
    """The refusal of ``node`` on the multi-GPU LTX-2 MODEL: why (``what``) and what to use instead."""
    return ModelPatchRefused(f"{node} on the multi-GPU LTX-2 MODEL: {what}; {instead}")


def _mappings() -> Mapping[str, type]:
    mod = sys.modules.get("nodes")
    mappings = getattr(mod, "NODE_CLASS_MAPPINGS", None)
    return mappings if isinstance(mappings, Mapping) else {}


def _ids(found: list[str]) -> str | None:
    """One node id, or ``A/B`` for a class registered under several (``ModelMergeSD1/ModelMergeSD2``)."""
    return "/".join(found) if found else None


def _node_of_class(name: str, module: str | None) -> str | None:
    """ComfyUI's node id of the node class called ``name`` (defined in ``module`` when given)."""
    return _ids([nid for nid, cls in _mappings().items() if getattr(cls, "__name__", None) == name
                 and (module is None or getattr(cls, "__module__", None) == module)])


def patch_node(patch: Any) -> str:
    """The node that made ``patch`` (a function, or an object with a ``__call__``): ComfyUI's
    node id of the class its ``__qualname__`` starts with (``SkipLayerGuidanceDiT.execute.<locals>
    .skip`` -> ``SkipLayerGuidanceDiT``), or the nodes of its module when they are few
    (``EasyCache or LazyCache``), or its qualified name and module."""
    target = patch if inspect.isfunction(patch) or inspect.ismethod(patch) else type(patch)
    qualname = getattr(target, "__qualname__", None) or repr(patch)
    module = getattr(target, "__module__", None)
    head = qualname.split(".", 1)[0]
    found = _node_of_class(head, module) if "." in qualname else None
    if found:
        return found
    same = [nid for nid, cls in _mappings().items() if getattr(cls, "__module__", None) == module]
    if 1 <= len(same) <= 3 and module != "nodes":
        return " or ".join(same)
    return f"{qualname} of {module}" if module else qualname


def caller_node(default: str = "a node") -> str:
    """The node whose code is running now: the nearest frame whose ``self`` / ``cls`` is a class
    of ``nodes.NODE_CLASS_MAPPINGS`` (or the per-run clone ComfyUI makes of a V3 node class), or
    whose function is defined in one (a patch closure: ``PerpNeg.execute.<locals>.cfg_function``);
    else ``default`` plus the executing node's id when ComfyUI says which."""
    classes: dict[int, list[str]] = {}
    for nid, c in _mappings().items():
        classes.setdefault(id(c), []).append(nid)
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("cls", None)
            if owner is None and "self" in frame.f_locals:
                owner = type(frame.f_locals["self"])
            if isinstance(owner, type):
                # the class itself, or the per-run clone ComfyUI makes of a V3 node (its first base)
                found = next((_ids(classes[id(c)]) for c in owner.__mro__[:2] if id(c) in classes), None)
                if found is not None:
                    return found
            qualname = getattr(frame.f_code, "co_qualname", "")  # a closure of a node's method (Python 3.11+)
            if "." in qualname:
                found = _node_of_class(qualname.split(".", 1)[0], frame.f_globals.get("__name__"))
                if found is not None:
                    return found
            frame = frame.f_back
    finally:
        del frame
    node = _comfy.executing_node_id()
    return f"{default} (node {node})" if node is not None else default


def _say(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        LOG.info("ltx_mgpu: %s", message)


def _identity_probe(replace: Callable) -> str:
    """``"skip"`` when the ``dit`` block replacement ``replace`` returns its input (ComfyUI's
    LTX-2 model then passes the block's hidden states through), ``"block"`` when it returns what
    the original block returns, ``"other"`` otherwise (it computes, or fails on stand-in inputs)."""
    img, out = object(), object()
    called = []

    def original(args):
        called.append(args)
        return {"img": out}

    args = {"img": img, "transformer_options": {}}
    try:
        got = replace(args, {"original_block": original})
    except Exception:  # noqa: BLE001 - a replacement that computes on its inputs is not a skip
        return "other"
    value = got.get("img") if isinstance(got, dict) else None
    if value is img and not called:
        return "skip"
    if value is out and len(called) == 1 and called[0] is args:
        return "block"
    return "other"


def call_plan(transformer_options: Mapping | None, blocks: int) -> tuple[int, ...]:
    """The transformer blocks one model call skips, from ComfyUI's ``transformer_options`` of
    that call (module doc): the ``dit`` double-block replacements that return their input, by
    index (those at or beyond ``blocks`` are skipped by no model, as in ComfyUI's). What ComfyUI's
    LTX-2 model does not read is logged once per node and left.

    Raises:
        ModelPatchRefused: an attention override, a branch switch set off, or a ``dit`` block
            replacement that computes (names the node that made it).
    """
    options = transformer_options or {}
    override = options.get("optimized_attention_override")
    if override is not None:
        raise refuse(patch_node(override), "its attention override (optimized_attention_override) cannot run in the "
                     "pool", "remove the node; the pool uses its own attention kernels")
    off = [k for k in BRANCH_SWITCHES if options.get(k, True) is False]
    if off:
        raise refuse(caller_node("a node upstream of the sampler"), f"switching off LTX-2's {off} branches is not "
                     "implemented in the pool", "remove the node, or sample ComfyUI's own CheckpointLoaderSimple model")
    for kind, entries in (options.get("patches") or {}).items():
        for patch in entries or ():
            node = patch_node(patch)
            _say(f"patches/{kind}/{node}", f"{node}'s {kind} (transformer_options['patches']) has no effect on LTX-2: "
                 "ComfyUI's own LTX-2 model does not read it either, so the multi-GPU model leaves it too")
    skip = []
    for name, entries in (options.get("patches_replace") or {}).items():
        for where, replace in (entries or {}).items():
            node = patch_node(replace)
            block = where[0] if isinstance(where, tuple) and where else where
            if (name, block) != _READ:
                _say(f"replace/{name}/{block}/{node}", f"{node}'s {name} replacement at {where} has no effect on "
                     "LTX-2: ComfyUI's own LTX-2 model does not read it either, so the multi-GPU model leaves it too")
                continue
            index = where[1] if len(where) > 1 and isinstance(where[1], int) else None
            kind = _identity_probe(replace)
            if index is None or kind == "other":
                raise refuse(node, f"its replacement of transformer block {where} computes, which cannot run in the "
                             "pool (only block skips, as skip-layer guidance makes, run there)", "remove the node")
            if kind == "skip" and index < blocks:
                skip.append(index)
    return tuple(sorted(set(skip)))


def check_sampling(model_options: Mapping, patcher: Any, compute_dtype: Any, blocks: int) -> None:
    """Check a sampling run's ``model_options`` (its guider's) and ``patcher`` before its first
    model call (:func:`call_plan` on its ``transformer_options``, conditioning hooks, the weight
    wrappers, the module injections, the compute dtype), and say once that ``TorchCompileModel``
    compiles nothing of ours.

    Raises:
        ModelPatchRefused: see :func:`call_plan`; conditioning hooks (``registered_hooks``: they
            patch ComfyUI's weights per conditioning); weight wrappers or module injections other
            than the bypass LoRAs' (their node named); ComfyUI's compute dtype
            (``ModelComputeDtype``) other than the pool's ``compute_dtype``.
    """
    call_plan(model_options.get("transformer_options"), blocks)
    hooks = model_options.get("registered_hooks")
    if hooks is not None and len(hooks) > 0:
        raise refuse("a conditioning hook node (CreateHookLora, CreateHookModelAsLora, ...)", "hooks change the "
                     "model per conditioning in ComfyUI's process, which the pool does not do",
                     "put the LoRA on the MODEL with LoraLoaderModelOnly instead")
    wrappers = getattr(patcher, "weight_wrapper_patches", None) or {}
    for key, functions in wrappers.items():
        node = patch_node(functions[0]) if functions else "a node"
        raise refuse(node, f"its weight wrappers ({key}) cannot run in the pool",
                     "remove the node; LoRAs go through the LoRA loaders")
    for key, injections in (getattr(patcher, "injections", None) or {}).items():
        if key != BYPASS_INJECTIONS:
            node = patch_node(injections[0].inject) if injections else "a node"
            raise refuse(node, f"its module injections ({key!r}) cannot run in the pool", "remove the node")
    dtype = (getattr(patcher, "object_patches", None) or {}).get("manual_cast_dtype")
    if dtype is not None and dtype != compute_dtype:
        raise compute_dtype_refusal("ModelComputeDtype", dtype, compute_dtype)
    if model_options.get("torch_compile_kwargs") is not None:
        _say("torch_compile", "TorchCompileModel compiles nothing of the multi-GPU LTX-2 model: its transformer runs "
             "in the pool, which compiles its own blocks (Model Loader compile: on, or dtype fp8); the sampling "
             "runs as without it")


def compute_dtype_refusal(node: str, dtype: Any, compute_dtype: Any) -> ModelPatchRefused:
    """The refusal of a compute dtype other than the pool's."""
    def name(d: Any) -> str:
        return str(d).removeprefix("torch.")

    return refuse(node, f"the pool computes in the Model Loader's dtype ({name(compute_dtype)}), not {name(dtype)}",
                  f"set the Model Loader's dtype instead (bf16, fp16, fp32 or fp8) and leave {node} at default")


def bypass_patches(reference: Any, prefix: str = "diffusion_model.") -> dict[str, list[tuple]]:
    """The bypass LoRAs injected into ``reference`` (the meta modules of ComfyUI's LTX-2 model that
    ComfyUI's ``BypassInjectionManager`` hooked, :mod:`comfy.weight_adapter.bypass`), as weight
    patches ``{key: [(strength, adapter, 1.0, None, None)]}`` (``strength``: the hook's
    multiplier), to be merged after the module's other patches."""
    out: dict[str, list[tuple]] = {}
    for name, module in reference.named_modules():
        hook = getattr(module.__dict__.get("forward"), "__self__", None)
        if hook is None or type(hook).__name__ != "BypassForwardHook" or getattr(hook, "module", None) is not module:
            continue
        out.setdefault(f"{prefix}{name}.weight", []).append((float(hook.multiplier), hook.adapter, 1.0, None, None))
    return out
