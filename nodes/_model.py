"""ComfyUI's ``MODEL`` whose LTX-2 transformer runs in the pool.

:func:`pool_model_patcher` builds, for an LTX-2 checkpoint, what ComfyUI's
``CheckpointLoaderSimple`` builds (``comfy.sd.load_checkpoint_guess_config``): the model config
from the checkpoint's header (``comfy.model_detection.model_config_from_unet``: model sampling,
latent format, the ``LTXAV`` extra conditions), ``comfy.model_base.LTXAV`` and a
``comfy.model_patcher.ModelPatcher`` — but without the transformer. Its ``diffusion_model`` is
a :class:`PoolDiffusionModel`: no weights, the patchifiers and the state-dict key names and
shapes (meta tensors) of ComfyUI's own ``LTXAVModel`` for that config, and a ``forward`` and a
``preprocess_text_embeds`` that are calls into the pool (:class:`ltx_mgpu.client.model.PoolModel`).
So ComfyUI runs its own sampling loop (any sampler, guider, scheduler), its LoRA loaders patch
our keys exactly as theirs (the patches reach the pool at the next call), and ComfyUI's model
management sees a model of one byte: ComfyUI reads no transformer weight. The other attributes of
ComfyUI's ``LTXAVModel`` (its modules with meta weights, ``in_channels``...) are read through to
that reference model, so nodes that look at them (``RenormCFG``, the bypass LoRA loaders) find
what they find on ComfyUI's own model. The MODEL is a ``PoolModelPatcher``
(``ModelPatcher`` whose merges, saves and compute-dtype changes are refused by node name), and
what ComfyUI's MODEL -> MODEL nodes add to it is honoured or refused as
:mod:`nodes._patches` says, checked when sampling starts (an ``OUTER_SAMPLE`` wrapper) and per call.

The audio-video cross-attention AdaLN convention of the installed ComfyUI is read from its
``LTXAVModel._prepare_timestep`` (raw sigma up to 0.20.1, scaled after Comfy-Org/ComfyUI#14097)
and followed, so the result equals the installed ComfyUI's own model; it is said once, at load.

Needs ComfyUI loaded in this process (:func:`~nodes._comfy.comfy_module`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import struct
import uuid
import weakref
from typing import Any

import torch

from . import _comfy
from ._patches import bypass_patches, call_plan, caller_node, check_sampling, compute_dtype_refusal, refuse

__all__ = ["PoolDiffusionModel", "av_timestep_convention", "checkpoint_vae", "pool_model_patcher"]

LOG = logging.getLogger("ltx_mgpu")
#: The key of the pack's sampling wrapper (``WrappersMP.OUTER_SAMPLE``) on its MODEL.
WRAPPER_KEY = "ltx_mgpu"
_said: set[str] = set()
#: Ids of the bypass LoRAs' adapters (weakly held), for the patch-set ids sent to the pool.
_HOOK_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _need(name: str):
    mod = _comfy.comfy_module(name)
    if mod is None:
        raise RuntimeError(f"the LTX-2 MODEL needs ComfyUI ({name} is not loaded); run the node inside ComfyUI")
    return mod


def _check_interrupt() -> None:
    """Raise ComfyUI's interrupt when Stop was pressed (called while a pool call is awaited)."""
    if _comfy.processing_interrupted():
        _comfy.raise_interrupt()


def av_timestep_convention() -> str:
    """``"raw"`` when the installed ComfyUI feeds LTX-2's audio-video cross-attention AdaLNs the
    raw sigma (up to 0.20.1: ``timestep.max()`` unscaled in ``LTXAVModel._prepare_timestep``),
    ``"scaled"`` otherwise (ltx-core's, and ComfyUI after Comfy-Org/ComfyUI#14097)."""
    avm = _need("comfy.ldm.lightricks.av_model")
    try:
        source = inspect.getsource(avm.LTXAVModel._prepare_timestep)
    except (OSError, TypeError, AttributeError):
        return "scaled"
    return "raw" if "timestep.max().expand_as(a_timestep_flat)" in source else "scaled"


class PoolDiffusionModel(torch.nn.Module):
    """The ``diffusion_model`` of our MODEL: ComfyUI's ``LTXAVModel`` interface, run in the pool.

    It holds no parameters; ``state_dict()`` lists ComfyUI's keys for this checkpoint as meta
    tensors (the key names and shapes ComfyUI's LoRA loaders match), and any other attribute of
    ComfyUI's ``LTXAVModel`` is its ``reference``'s (meta modules: what ComfyUI's bypass LoRA
    loader hooks, read back by :func:`nodes._patches.bypass_patches`). ``forward`` takes what
    ``BaseModel._apply_model`` passes (``x``: ``[video, audio]`` or the video latent in the model
    dtype, ``timestep``: ``(video, audio)`` from ``LTXAV.process_timestep``, ``context``: the
    processed text context, ``frame_rate``, ``attention_mask``, ``transformer_options`` and the
    extra conditions), runs ComfyUI's ``DIFFUSION_MODEL`` wrappers around the pool call as
    ``LTXAVModel.forward`` runs them around its ``_forward`` (EasyCache), and returns the
    velocities in ``x``'s layout.

    Raises (from ``forward``):
        ltx_mgpu.client.errors.BadInputError: a ControlNet; conditioning the pool does not
            implement (keyframe guides, reference audio...), named; inputs the pool refuses.
        nodes._patches.ModelPatchRefused: a model patch the pool does not run (names its node).
        ltx_mgpu.client.model.PatchFormatError: LoRA patches the pool cannot merge exactly.
        ComfyUI's interrupt on Stop (the pool call in flight is abandoned; the pool finishes it
        and serves on).
    """

    def __init__(self, pool_model, reference: torch.nn.Module, dtype: torch.dtype, owner: torch.nn.Module):
        super().__init__()
        self.pool_model = pool_model
        self.patchifier, self.a_patchifier, self.dtype = reference.patchifier, reference.a_patchifier, dtype
        self._keys = dict(reference.state_dict())
        self.block_count = len(reference.transformer_blocks)
        self.__dict__["reference"] = reference  # not a submodule: no keys, nothing for ComfyUI to load or move
        self._owner = weakref.ref(owner)  # the BaseModel (not a submodule: no cycle in modules())
        # a call into the pool: nothing for ComfyUI's torch.compile (TorchCompileModel) to trace; set
        # here, not as a decorator, so that importing the pack does not import torch's compiler
        self.__dict__["forward"] = torch.compiler.disable(self.forward)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            reference = self.__dict__.get("reference")
            if reference is None or name.startswith("__"):
                raise
            return getattr(reference, name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ARG002 - nn.Module's signature
        for k, v in self._keys.items():
            destination[prefix + k] = v

    def _patches(self) -> tuple[str, Any]:
        """``(id, patches)`` of the calling ModelPatcher: its weight patches, then its bypass
        LoRAs' as LoRA patches (:func:`nodes._patches.bypass_patches`)."""
        from ltx_mgpu.wire.messages import NO_PATCHES  # the wire loads only where a pool can run

        owner = self._owner()
        patcher = getattr(owner, "current_patcher", None) if owner is not None else None
        if patcher is None:
            return NO_PATCHES, None
        patches, pid = patcher.patches, str(patcher.patches_uuid)
        if getattr(patcher, "injections", None):
            bypass = bypass_patches(self.__dict__["reference"])
            if bypass:
                patches = {k: [*patches.get(k, ()), *bypass.get(k, ())] for k in {*patches, *bypass}}
                hooks = [_HOOK_IDS.setdefault(p[1], uuid.uuid4().hex[:8]) + f"x{p[0]!r}"
                         for k in sorted(bypass) for p in bypass[k]]
                pid += "+bypass-" + hashlib.sha1(",".join(hooks).encode()).hexdigest()[:16]
        return pid, patches

    def preprocess_text_embeds(self, context: torch.Tensor, unprocessed: bool = False) -> torch.Tensor:
        """ComfyUI's ``LTXAVModel.preprocess_text_embeds``, by the pool's connectors (with the
        calling ModelPatcher's weight patches merged, as ComfyUI's model has them)."""
        return self.pool_model.text_contexts(context, unprocessed, check_interrupt=_check_interrupt,
                                             patches=self._patches())

    def forward(self, x, timestep, context, attention_mask=None, frame_rate=25, transformer_options=None,
                keyframe_idxs=None, **kwargs):
        """``LTXAVModel.forward``: the audio timestep split off as ``a_timestep``, then ComfyUI's
        ``DIFFUSION_MODEL`` wrappers around :meth:`_forward` with ``LTXBaseModel.forward``'s arguments."""
        extension = _need("comfy.patcher_extension")
        options = transformer_options if transformer_options is not None else {}
        if isinstance(timestep, (tuple, list)) and len(timestep) == 2:
            timestep, kwargs["a_timestep"] = timestep
        else:
            kwargs["a_timestep"] = timestep
        denoise_mask = kwargs.pop("denoise_mask", None)
        wrappers = extension.get_all_wrappers(extension.WrappersMP.DIFFUSION_MODEL, options)
        return extension.WrapperExecutor.new_class_executor(self._forward, self, wrappers).execute(
            x, timestep, context, attention_mask, frame_rate, options, keyframe_idxs, denoise_mask=denoise_mask,
            **kwargs)

    def _forward(self, x, timestep, context, attention_mask=None, frame_rate=25, transformer_options=None,
                 keyframe_idxs=None, denoise_mask=None, a_timestep=None, control=None, **kwargs):
        from ltx_mgpu.client.errors import BadInputError  # the client loads only where a pool can run

        if control is not None:
            raise BadInputError(f"a ControlNet cannot be applied to the multi-GPU LTX-2 model{_in_node()}")
        if isinstance(x, torch.Tensor):  # ComfyUI's LTXAVModel takes x[0] as the video latent: it fails too
            raise refuse(caller_node("a node"), "it calls the model with a latent that is not ComfyUI's "
                         "[video, audio] list (its conditioning lacks latent_shapes), on which ComfyUI's own LTX-2 "
                         "model fails as well", "remove the node (for PerpNeg: use PerpNegGuider)")
        skip = call_plan(transformer_options, self.block_count)
        conds = {**kwargs, "keyframe_idxs": keyframe_idxs, "attention_mask": attention_mask,
                 "denoise_mask": denoise_mask}
        steps = (timestep, timestep if a_timestep is None else a_timestep)
        return self.pool_model.forward(x, steps, context, frame_rate=float(frame_rate), conds=conds,
                                       patches=self._patches(), check_interrupt=_check_interrupt, where=_in_node(),
                                       skip_blocks=skip, timestep_range=self._timestep_range())

    def _timestep_range(self) -> tuple[float, float] | None:
        """The timesteps the active model sampling gives (``ModelSampling*`` nodes patch it):
        ``timestep(sigma)`` at its ``sigma_min`` and ``sigma_max``, and 0 (a denoise mask scales a
        timestep towards 0), widened by 1e-4 of the span for rounding; None without one."""
        sampling = getattr(self._owner(), "model_sampling", None)
        try:
            ends = [float(sampling.timestep(torch.tensor(float(s)))) for s in (sampling.sigma_min, sampling.sigma_max)]
        except Exception:  # noqa: BLE001 - no or an unusual model sampling: the pool's default range applies
            return None
        low, high = min(0.0, *ends), max(0.0, *ends)
        pad = 1e-4 * (high - low or 1.0)
        return low - pad, high + pad


_PATCHER: dict[str, type] = {}


def _patcher_class() -> type:
    """``PoolModelPatcher``: ComfyUI's ``ModelPatcher`` (a MODEL; its clones keep the class) whose
    weights live in the pool, so ComfyUI's merges and saves are refused by the name of the node
    that asks (they read or mix in weights: ``get_key_patches``, a patch made of another model's
    weights, ``state_dict_for_saving``), and so is a compute dtype other than the pool's
    (``set_model_compute_dtype``: ``ModelComputeDtype``). Each raises
    :class:`nodes._patches.ModelPatchRefused` inside that node, before any model call. Made once,
    when ComfyUI's ``ModelPatcher`` can be subclassed."""
    cls = _PATCHER.get("class")
    if cls is not None:
        return cls

    class PoolModelPatcher(_need("comfy.model_patcher").ModelPatcher):
        def get_key_patches(self, filter_prefix=None):  # noqa: ARG002 - ModelPatcher's signature
            raise refuse(caller_node("a merge node"), "its weights live in the pool, so ComfyUI cannot merge them "
                         "into another model", _MERGE_INSTEAD)

        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
            if any(isinstance(v, list) for v in patches.values()):  # another model's weights (a merge's model2)
                raise refuse(caller_node("a merge node"), "another model's weights cannot be merged into the pool's",
                             _MERGE_INSTEAD)
            return super().add_patches(patches, strength_patch, strength_model)

        def state_dict_for_saving(self, *args, **kwargs):  # noqa: ARG002 - ModelPatcher's signature
            raise refuse(caller_node("a save node"), "its weights live in the pool, so ComfyUI cannot save them",
                         "save from ComfyUI's own CheckpointLoaderSimple model with the same LoRA nodes instead")

        def set_model_compute_dtype(self, dtype):
            own = self.model.diffusion_model.dtype
            if dtype is not None and dtype != own:
                raise compute_dtype_refusal(caller_node("ModelComputeDtype"), dtype, own)
            return super().set_model_compute_dtype(dtype)

    _PATCHER["class"] = PoolModelPatcher
    return PoolModelPatcher


_MERGE_INSTEAD = ("merge the checkpoints with ComfyUI's own loaders (CheckpointLoaderSimple -> ModelMergeSimple -> "
                  "ModelSave) and load the saved file with the Model Loader")


def _outer_sample(executor, *args, **kwargs):
    """The MODEL's ``OUTER_SAMPLE`` wrapper: :func:`nodes._patches.check_sampling` on the guider's
    model options before the run's first model call, then the run."""
    guider = executor.class_obj
    patcher = guider.model_patcher
    model = patcher.model.diffusion_model
    check_sampling(guider.model_options, patcher, model.dtype, model.block_count)
    return executor(*args, **kwargs)


def _in_node() -> str:
    """`` in node 12`` for the node ComfyUI is executing (``comfy_execution.utils``), else ``""``."""
    try:
        from comfy_execution.utils import get_executing_context

        running = get_executing_context()
    except Exception:  # noqa: BLE001 - an older ComfyUI or none: the message just names no node
        return ""
    node = getattr(running, "node_id", None)
    return f" in node {node}" if node is not None else ""


#: The largest safetensors header read (the format's own limit is 100 MB).
_MAX_HEADER = 100 << 20


def _header(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The checkpoint's tensors as meta tensors (shapes and dtypes from its header) and its
    metadata. Only the header is read (safetensors: a little-endian u64 length, then that many
    bytes of JSON, https://github.com/huggingface/safetensors; GGUF: read by ``gguf``'s reader,
    :class:`ltx_mgpu.quantized.ggml.GGUFFile`, a quantized tensor given its logical shape and
    bf16, as ComfyUI-GGUF's loader gives it): nothing of the file is read beyond it.

    Raises:
        ValueError: neither a safetensors nor a GGUF file.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:4] == b"GGUF":
            return _gguf_header(path)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        raw = f.read(n) if 0 < n <= _MAX_HEADER else b""
    try:
        header = json.loads(raw) if len(raw) == n and n else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is neither a .safetensors nor a .gguf file (its header cannot be read)")
    from ltx_mgpu.wire.payload import DTYPES  # safetensors' dtype codes; the wire loads only where a pool can run

    metadata = header.pop("__metadata__", None) or {}
    sd = {key: torch.empty(info["shape"], dtype=DTYPES.get(info["dtype"], torch.float32), device="meta")
          for key, info in header.items()}
    return sd, metadata


def _gguf_header(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """:func:`_header` of a GGUF file (its ``config`` string field as the metadata, when kept)."""
    from ltx_mgpu.quantized.ggml import GGMLFormatError, GGUFFile  # only GGUF files need it

    try:
        f = GGUFFile(path)
    except GGMLFormatError as e:
        raise ValueError(str(e)) from None
    dtypes = {"F32": torch.float32, "F16": torch.float16}
    sd = {name: torch.empty(t.shape, dtype=dtypes.get(t.qtype, torch.bfloat16), device="meta")
          for name, t in f.tensors.items()}
    config = f.field("config")
    return sd, ({"config": config} if isinstance(config, str) else {})


def _config(checkpoint: str):
    """``(meta state dict, metadata, diffusion-model prefix, ComfyUI model config)`` of an LTX-2 file.

    Raises:
        ValueError: not an LTX-2 audio-video checkpoint ComfyUI recognises.
    """
    detection = _need("comfy.model_detection")
    sd, metadata = _header(checkpoint)
    prefix = detection.unet_prefix_from_state_dict(sd)
    if not any(k.startswith(prefix) for k in sd):
        prefix = ""
    config = detection.model_config_from_unet(sd, prefix, metadata=metadata)
    if config is None or config.unet_config.get("image_model") != "ltxav":
        raise ValueError(f"{checkpoint} is not an LTX-2 audio-video checkpoint ComfyUI recognises")
    return sd, metadata, prefix, config


def checkpoint_vae(checkpoint: str):
    """The checkpoint's video VAE as ComfyUI's ``CheckpointLoaderSimple`` builds it (its
    ``vae_key_prefix`` tensors, ``process_vae_state_dict``, ``comfy.sd.VAE``), reading only those
    tensors; None when the file holds none (a transformer-only file).

    Raises:
        RuntimeError: ComfyUI is not loaded. ValueError: not an LTX-2 checkpoint.
    """
    from safetensors import safe_open

    sd_mod = _need("comfy.sd")
    if _is_gguf(checkpoint):  # a GGUF transformer holds no VAE (ComfyUI-GGUF's converters keep the DiT only)
        return None
    _, metadata, _, config = _config(checkpoint)
    prefixes = tuple(config.vae_key_prefix)
    with safe_open(checkpoint, framework="pt", device="cpu") as f:
        vae = {}
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            p = next((p for p in prefixes if key.startswith(p)), None)
            if p is not None:
                vae[key[len(p):]] = f.get_tensor(key)
    if not vae:
        return None
    return sd_mod.VAE(sd=config.process_vae_state_dict(vae), metadata=metadata)


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def pool_model_patcher(pool_model, checkpoint: str, compute_dtype: str):
    """A ComfyUI ``ModelPatcher`` (a ``PoolModelPatcher``, :func:`_patcher_class`) for ``checkpoint`` whose
    transformer is ``pool_model`` (module doc).

    Args:
        pool_model: the :class:`ltx_mgpu.client.model.PoolModel` of the transformer loaded from
            ``checkpoint``; its ``av_timestep`` is set to the installed ComfyUI's convention.
        checkpoint: the monolith or transformer-only ``.safetensors`` path, or a GGUF transformer.
        compute_dtype: the pool's compute dtype by torch's name (``TransformerPlan.compute_dtype``:
            ``"bfloat16"`` for dtype bf16 and fp8), reported to ComfyUI as the model's (ComfyUI casts
            the latent to it before each call, as for its own).
    Raises:
        RuntimeError: ComfyUI is not loaded. ValueError: not an LTX-2 audio-video checkpoint.
    """
    mm, ops = _need("comfy.model_management"), _need("comfy.ops")
    avm = _need("comfy.ldm.lightricks.av_model")
    sd, _, prefix, config = _config(checkpoint)
    torch_dtype = getattr(torch, compute_dtype)
    config.set_inference_dtype(torch_dtype, None)
    unet_config = {k: v for k, v in config.unet_config.items() if k != "disable_unet_model_creation"}
    with torch.device("meta"):  # ComfyUI's own module: its key names, shapes, patchifiers and attributes
        reference = avm.LTXAVModel(**unet_config, device="meta", operations=ops.disable_weight_init)
    config.unet_config["disable_unet_model_creation"] = True
    base = config.get_model(sd, prefix, device=torch.device("cpu"))
    base.diffusion_model = PoolDiffusionModel(pool_model, reference, torch_dtype, base)
    base.memory_usage_factor = 0.0  # activations live in the pool: ComfyUI batches cond and uncond freely
    del sd
    pool_model.av_timestep = av_timestep_convention()
    if pool_model.av_timestep not in _said:
        _said.add(pool_model.av_timestep)
        how = ("the raw sigma, as this ComfyUI does (up to 0.20.1)" if pool_model.av_timestep == "raw" else
               "sigma x 1000, as this ComfyUI and ltx-core do")
        LOG.info("ltx_mgpu: the pool's LTX-2 MODEL feeds its audio-video cross-attention AdaLNs %s, so it equals "
                 "this ComfyUI's own model", how)
    patcher = _patcher_class()(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device(),
                               size=1)
    patcher.add_wrapper_with_key(_need("comfy.patcher_extension").WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample)
    return patcher
