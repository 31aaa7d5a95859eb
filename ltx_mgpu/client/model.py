"""The MODEL path's client side: ComfyUI's own sampler runs its loop and calls the model; the
pool runs the LTX-2 transformer, sequence-parallel over its ranks (``ltx_mgpu.pool.model_jobs``).

A :class:`PoolModel` stands for one transformer resident in a pool (``load_transformer``) and
makes the three calls ComfyUI's ``LTXAV`` model makes of its diffusion model:

* :meth:`PoolModel.text_contexts`: ``preprocess_text_embeds`` (the text connectors), once per
  conditioning when a sampling run starts;
* :meth:`PoolModel.forward`: the transformer call, once per model evaluation of the sampler.
  Per call it sends the latent parts and their timesteps and receives the velocities. The text
  context is sent once: the client keeps (at most :data:`CONTEXTS_KEPT`) the contexts it sent
  and compares each call's with them (``torch.equal``: by content, as ComfyUI concatenates a
  fresh batch every step), the pool keeps them under the id;
* :meth:`PoolModel.sync_patches`: ComfyUI's weight patches (what its LoRA loaders add to a
  MODEL), merged in the pool when they differ from the merged ones. Each adapter (a LoRA's
  factor pair, a diff tensor) gets an id from its object's identity and its tensors are sent
  once per pool model; a strength change sends only the new strengths.

Whatever the pool cannot hold any more (it restarted, the model was freed and loaded again,
another graph merged other patches) it reports with a ``reason`` (``no_model``,
``unknown_context``, ``stale_patches``, ``unknown_adapter``) and the call is remedied (load,
resend) and retried. Patches ComfyUI can build but the pool cannot merge exactly (LoHa, LoKr,
DoRA, OFT, offsets, functions) are refused by key and kind, before any pool work.

Only torch and the wire are imported (no ltx-core, no ComfyUI): ComfyUI's process stays light.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.wire.codec import DEFAULT_MODEL
from ltx_mgpu.wire.messages import FORWARD_KWARGS, GUIDE_FIELDS, NO_PATCHES

__all__ = ["BUSY_WINDOW_S", "CONTEXTS_KEPT", "SCALE", "PatchFormatError", "PoolModel", "WirePatches",
           "model_activity", "wire_conds", "wire_patches"]

#: Text contexts the client remembers having sent (the pool keeps as many; see
#: ``ltx_mgpu.pool.model_jobs.CONTEXT_SLOTS``).
CONTEXTS_KEPT = 4
#: Tries of one call when the pool reports something it can be given (module doc).
_TRIES = 4
#: A pool whose MODEL was called within this many seconds is sampling (ComfyUI's sampler is
#: between two calls): :func:`model_activity`.
BUSY_WINDOW_S = 2.0
_MODELS: weakref.WeakSet = weakref.WeakSet()
#: The adapter id of a scale-only patch (kind ``"scale"``: no tensors).
SCALE = "scale"


def model_activity(pool_dir: str, within: float = BUSY_WINDOW_S) -> dict | None:
    """``{"calls", "since", "last"}`` (model calls, ``time.monotonic()`` of the first and last)
    of the current sampling run of any :class:`PoolModel` of this process on the pool in
    ``pool_dir``, when one was called within ``within`` seconds; else None. A pool runs no job
    between the calls of ComfyUI's sampler: this tells that it is still in use."""
    now = time.monotonic()
    for m in list(_MODELS):
        if m.last_call is None or now - m.last_call > within:
            continue
        try:
            same = str(m.client().spec.dir) == str(pool_dir)
        except Exception:  # noqa: BLE001 - a model whose client is gone is not in use
            continue
        if same:
            return {"calls": m.run_calls, "since": m.run_since, "last": m.last_call}
    return None


class PatchFormatError(ValueError):
    """A ComfyUI weight patch the pool cannot merge exactly (names the key and the patch kind)."""


@dataclasses.dataclass(frozen=True)
class WirePatches:
    """A ComfyUI patch set in the ``model_patches`` request's terms.

    Attributes:
        entries: ``[{"key", "patches": [{"adapter", "strength", "strength_model"}]}]``.
        adapters: adapter id -> ``({"id", "kind", "alpha"}, {tensor name: tensor})``.
    """

    entries: list
    adapters: dict


class _AdapterIds:
    """Ids for adapter objects by identity (a weak reference tells a reused ``id()`` apart)."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[Any, str]] = {}

    def __call__(self, obj: Any) -> str:
        entry = self._ids.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        aid = uuid.uuid4().hex[:16]
        key = id(obj)
        self._ids[key] = (weakref.ref(obj, lambda _r, k=key: self._ids.pop(k, None)), aid)
        return aid


def _tensor(value: Any, key: str, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise PatchFormatError(f"{key}: the {what} of its patch is {type(value).__name__}, not a tensor")
    return value.detach().to("cpu").contiguous()


def _adapter(v: Any, key: str, ids: _AdapterIds) -> tuple[str, dict, dict]:
    """``(id, description, tensors)`` of one patch's adapter ``v`` (ComfyUI's forms, by duck typing)."""
    name = getattr(v, "name", None)
    weights = getattr(v, "weights", None)
    if name is not None and weights is not None:  # comfy.weight_adapter.WeightAdapterBase
        if name != "lora":
            raise PatchFormatError(f"{key}: a {name!r} adapter (LyCORIS) cannot be merged in the pool; only plain "
                                   "LoRAs and diffs can: convert the file to a LoRA (lora_up / lora_down)")
        up, down, alpha, mid, dora, reshape = (tuple(weights) + (None,) * 6)[:6]
        for what, value in (("LoCon mid weights", mid), ("DoRA scale", dora), ("reshape", reshape)):
            if value is not None:
                raise PatchFormatError(f"{key}: LoRAs with {what} cannot be merged in the pool; use a plain LoRA")
        aid = ids(v)
        alpha = None if alpha is None else float(alpha)
        tensors = {f"{aid}.up": _tensor(up, key, "up matrix"), f"{aid}.down": _tensor(down, key, "down matrix")}
        return aid, {"id": aid, "kind": "lora", "alpha": alpha}, tensors
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        kind, data = v
        if kind != "diff":
            raise PatchFormatError(f"{key}: a {kind!r} patch cannot be merged in the pool (only LoRAs and diffs)")
        if len(data) > 1 and isinstance(data[1], dict) and data[1].get("pad_weight"):
            raise PatchFormatError(f"{key}: a diff that pads the weight (a changed shape) cannot be merged in the pool")
        v = data
    if isinstance(v, tuple) and len(v) >= 1 and isinstance(v[0], torch.Tensor):
        aid = ids(v[0])
        return aid, {"id": aid, "kind": "diff", "alpha": None}, {f"{aid}.diff": _tensor(v[0], key, "diff")}
    if isinstance(v, tuple) and len(v) == 1 and v[0] is None:  # ComfyUI's scale-only diff (strength 0)
        return SCALE, {"id": SCALE, "kind": "scale", "alpha": None}, {}
    raise PatchFormatError(f"{key}: a patch of type {type(v).__name__} cannot be merged in the pool (only LoRAs and "
                           "diffs)")


def wire_patches(patches: Mapping[str, Sequence], ids: Callable[[Any], str]) -> WirePatches:
    """ComfyUI's ``ModelPatcher.patches`` (key -> ``[(strength, adapter, strength_model, offset,
    function)]``) as a :class:`WirePatches`.

    A diff patch without a tensor, ``(None,)`` at strength 0 (the attention multiplier nodes'),
    only scales the weight by its ``strength_model``: it references the adapter :data:`SCALE`.

    Raises:
        PatchFormatError: an offset or function patch, or an adapter kind other than a plain
            LoRA, a diff or a scale (names the key).
    """
    entries, adapters = [], {}
    for key in sorted(patches):
        plist = []
        for p in patches[key]:
            strength, v, strength_model = p[0], p[1], p[2]
            offset = p[3] if len(p) > 3 else None
            function = p[4] if len(p) > 4 else None
            if offset is not None or function is not None:
                raise PatchFormatError(f"{key}: patches with an offset or a function cannot be merged in the pool")
            aid, desc, tensors = _adapter(v, key, ids)
            if aid == SCALE and float(strength) != 0.0:
                raise PatchFormatError(f"{key}: a diff patch without a tensor at strength {strength} (ComfyUI cannot "
                                       "merge it either)")
            adapters[aid] = (desc, tensors)
            plist.append({"adapter": aid, "strength": float(strength), "strength_model": float(strength_model)})
        if plist:
            entries.append({"key": key, "patches": plist})
    return WirePatches(entries, adapters)


def wire_conds(conds: Mapping[str, Any], where: str = "") -> tuple[dict, dict]:
    """ComfyUI's keyword arguments of a model call as a ``forward`` request's ``(params,
    tensors)`` (``ltx_mgpu.wire.messages.FORWARD_TENSORS``): ``kwargs`` names those present;
    ``attention_mask``, ``keyframe_idxs``, ``ref_audio`` (its ``tokens``) travel as tensors; the
    video ``denoise_mask`` only with keyframes, as sample 0's minimum over channels (all that
    ComfyUI's grid mask reads: a token leaves the call where any channel is negative); the guide
    entries as ``guides`` (their pixel masks as ``guide.<i>.pixel_mask``). The pool checks the
    values (``ltx_mgpu.denoise.comfyui.extra_conds``).

    This is the client's one check of ComfyUI's keyword arguments (the pool's schema checks the
    ``kwargs`` names again, as it checks every request); ``where`` (e.g. ``" in node 12"``) is put
    into the messages.

    Raises:
        BadInputError: a keyword outside ``FORWARD_KWARGS`` (a node upstream added conditioning
            or a model patch this pool does not implement), guide entries that are not dicts of
            ``GUIDE_FIELDS``, reference audio without tokens.
    """
    present = {k: v for k, v in conds.items() if v is not None}
    refused = sorted(set(present) - set(FORWARD_KWARGS) - {"attention_mask"})
    if refused:
        raise BadInputError(f"the model call{where} has argument(s) {refused} the multi-GPU LTX-2 model does not "
                            f"implement (it implements {[*FORWARD_KWARGS, 'attention_mask']} and frame_rate); a "
                            "node upstream of the sampler added them: remove it, or update ltx_mgpu if a newer "
                            "ComfyUI adds them")
    params: dict = {"kwargs": sorted(k for k in present if k != "attention_mask")}
    tensors: dict = {}
    if "attention_mask" in present:
        tensors["attention_mask"] = _cpu(present["attention_mask"])
    if "keyframe_idxs" in present:
        tensors["keyframe_idxs"] = _cpu(present["keyframe_idxs"]).float()
        mask = present.get("denoise_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 5:
            tensors["denoise_mask"] = _cpu(mask[:1].amin(dim=1, keepdim=True)).float()
    if "ref_audio" in present:
        ref = present["ref_audio"]
        tokens = ref.get("tokens") if isinstance(ref, dict) else ref
        if not isinstance(tokens, torch.Tensor):
            raise BadInputError("ref_audio (from LTXVReferenceAudio) must hold a 'tokens' tensor")
        tensors["ref_audio"] = _cpu(tokens)
    entries = present.get("guide_attention_entries")
    if entries:
        if not isinstance(entries, (list, tuple)) or not all(isinstance(e, dict) for e in entries):
            raise BadInputError("guide_attention_entries (from LTXVAddGuide) must be a list of dicts")
        guides = []
        for i, e in enumerate(entries):
            unknown = sorted(set(e) - set(GUIDE_FIELDS))
            if unknown:
                raise BadInputError(f"guide_attention_entries[{i}]{where} has the field(s) {unknown} the multi-GPU "
                                    f"pool does not implement (implemented: {list(GUIDE_FIELDS)}); update ltx_mgpu")
            shape = e.get("latent_shape")
            guides.append({"pre_filter_count": e.get("pre_filter_count"), "strength": e.get("strength", 1.0),
                           "latent_shape": list(shape) if isinstance(shape, (list, tuple)) else shape})
            if isinstance(e.get("pixel_mask"), torch.Tensor):
                tensors[f"guide.{i}.pixel_mask"] = _cpu(e["pixel_mask"]).float()
        params["guides"] = guides
    return params, tensors


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


class PoolModel:
    """One transformer resident in a pool, called as ComfyUI calls its diffusion model.

    Args:
        client: ``() -> PoolClient`` (called per request, so a restarted pool is used).
        load: ``() -> dict``: loads the model in the pool (``load_transformer``) and returns its
            result; called again when the pool reports the model gone.
        name: its resident name; av_timestep: ``"scaled"`` / ``"raw"`` (``ltx_mgpu.choices``).
        key: the ``key`` of the load's result: every call names it, so a call never runs another
            model loaded under ``name`` since (the pool says ``no_model`` and it is loaded again).
    """

    def __init__(self, client: Callable[[], Any], load: Callable[[], dict], name: str = DEFAULT_MODEL,
                 av_timestep: str = "scaled", key: str | None = None):
        self.client, self.load, self.name, self.av_timestep, self.key = client, load, name, av_timestep, key
        self._lock = threading.RLock()
        self._contexts: list[tuple[torch.Tensor, str]] = []
        self._pool_patches = NO_PATCHES  # the patch set the pool has merged, as far as we know
        self._pool_adapters: set[str] = set()
        self._ids = _AdapterIds()
        #: Requests sent, by type, and context tensors sent (what a run costs on the wire).
        self.sent: dict[str, int] = {}
        #: ``time.monotonic()`` of the last forward, of the first of this run, and its forwards.
        self.last_call: float | None = None
        self.run_since: float | None = None
        self.run_calls = 0
        #: The last call's ``time.monotonic()`` marks: the client's (``sent``, ``arrived``,
        #: ``queued``, ``returned``: ``Job.clock``) and the pool's (``received``, ``started``,
        #: ``finished``: the result's ``timeline``), for the benchmarks.
        self.last_clock: dict[str, float] = {}
        _MODELS.add(self)

    # ------------------------------------------------------------------ plumbing

    def _request(self, mtype: str, params: dict, tensors: dict, check_interrupt, receive=None) -> tuple[dict, dict]:
        self.sent[mtype] = self.sent.get(mtype, 0) + 1
        named = {"model": self.name, **({"key": self.key} if self.key else {}), **params}
        job = self.client().submit(mtype, named, tensors, receive=receive)
        result, out = job.wait(should_cancel=check_interrupt)
        self.last_clock = {**result.get("timeline", {}), **job.clock}
        return result, out

    def _reloaded(self) -> None:
        """The pool lost the model: load it again; it holds no context, adapter or patch now."""
        loaded = self.load()
        if isinstance(loaded, dict) and loaded.get("key"):
            self.key = loaded["key"]
        self._contexts.clear()
        self._pool_patches, self._pool_adapters = NO_PATCHES, set()

    # ------------------------------------------------------------------ calls

    def text_contexts(self, context: torch.Tensor, unprocessed: bool, check_interrupt=None,
                      patches: tuple[str, Mapping[str, Sequence] | None] = (NO_PATCHES, None)) -> torch.Tensor:
        """ComfyUI's ``preprocess_text_embeds(context, unprocessed)``: the processed context
        ``[B, L, Dv + Da]`` in the model dtype, on ``context``'s device, by the connectors with
        ``patches`` merged (``(patches_uuid, patches)`` of the calling ModelPatcher, as in
        :meth:`forward`: a patch of a connector weight changes the context, as in ComfyUI's model).

        ``check_interrupt()`` is called while waiting; what it raises abandons the call.

        Raises:
            BadInputError: a context the model's connectors do not take (names the widths).
            PatchFormatError: see :meth:`sync_patches`.
        """
        with self._lock:
            for _ in range(_TRIES):
                self.sync_patches(*patches, check_interrupt=check_interrupt)
                try:
                    _, out = self._request("text_contexts", {"unprocessed": bool(unprocessed),
                                                             "patches": self._pool_patches},
                                           {"context": _cpu(context)}, check_interrupt)
                    return out["context"].to(context.device)
                except BadInputError as e:
                    if e.reason == "stale_patches":
                        self._pool_patches = None
                        continue
                    if e.reason != "no_model":
                        raise
                    self._reloaded()
            raise BadInputError(f"the pool could not process a text context for model '{self.name}' ({_TRIES} tries)")

    def _context_id(self, context: torch.Tensor) -> tuple[str, bool]:
        """``(id, new)``: the id of a context sent before with equal content, or a new one."""
        for kept, cid in self._contexts:
            if kept is context or (kept.shape == context.shape and kept.dtype == context.dtype
                                   and kept.device == context.device and torch.equal(kept, context)):
                return cid, False
        cid = uuid.uuid4().hex[:16]
        self._contexts.append((context, cid))
        del self._contexts[:-CONTEXTS_KEPT]
        return cid, True

    def sync_patches(self, patches_id: str, patches: Mapping[str, Sequence] | None, check_interrupt=None) -> None:
        """Have the pool merge ComfyUI's ``patches`` (``ModelPatcher.patches``) under
        ``patches_id`` (its ``patches_uuid``), unless it already has; an empty set restores the
        loaded weights.

        Raises:
            PatchFormatError: a patch the pool cannot merge exactly (before any request).
            BadInputError: the pool refused a key or factor (the message names the key).
        """
        with self._lock:
            wire = wire_patches(patches or {}, self._ids)
            patches_id = patches_id if wire.entries else NO_PATCHES
            if patches_id == self._pool_patches:
                return
            for _ in range(_TRIES):
                send = {aid: d for aid, d in wire.adapters.items() if aid not in self._pool_adapters}
                tensors = {name: t for _, ts in send.values() for name, t in ts.items()}
                params = {"patches": patches_id, "entries": wire.entries, "adapters": [d for d, _ in send.values()]}
                try:
                    result, _ = self._request("model_patches", params, tensors, check_interrupt)
                except BadInputError as e:
                    if e.reason == "unknown_adapter":
                        self._pool_adapters = set()
                        continue
                    if e.reason == "no_model":
                        self._reloaded()
                        continue
                    raise
                self._pool_patches, self._pool_adapters = result["patches"], set(result["adapters"])
                return
            raise BadInputError(f"the pool did not keep the weight patches of '{self.name}' ({_TRIES} tries)")

    def forward(self, x: Any, timestep: Any, context: torch.Tensor, *, frame_rate: float = 25.0,
                conds: Mapping[str, Any] | None = None,
                patches: tuple[str, Mapping[str, Sequence] | None] = (NO_PATCHES, None),
                check_interrupt=None, where: str = "", skip_blocks: Sequence[int] = (),
                timestep_range: tuple[float, float] | None = None) -> Any:
        """One call of the transformer as ComfyUI's ``LTXAVModel.forward`` (``x``: the video
        latent or ``[video, audio]``; ``timestep``: ``(video, audio)`` timesteps or one;
        ``context``: the processed context). Returns ``[video, audio]`` velocities, or the video
        velocity alone when there is no audio (ComfyUI's ``recombine_audio_and_video_latents``),
        in the model dtype on ``x``'s device.

        ``conds`` holds the call's other ComfyUI keyword arguments (``FORWARD_KWARGS`` and the
        text ``attention_mask``; None values are absent), sent as :func:`wire_conds` encodes
        them; ``patches`` is ``(patches_uuid, patches)`` of the calling ModelPatcher, merged
        first when the pool holds others. ``where`` names the caller in messages (``" in node 12"``).
        ``skip_blocks``: the transformer blocks this call passes through unchanged (ComfyUI's
        skip-layer guidance; ``ltx_mgpu.denoise.comfyui.skip_blocks``). ``timestep_range``: the
        ``(low, high)`` timesteps of the caller's model sampling (None: LTX-2's sigmas, 0..1).

        Raises:
            BadInputError: a keyword argument outside ``FORWARD_KWARGS`` or a guide entry of
                unknown fields (before any request), inputs the pool refuses (names them).
            PatchFormatError: see :meth:`sync_patches`.
        """
        cond_params, cond_tensors = wire_conds(conds or {}, where)
        if skip_blocks:
            cond_params["skip_blocks"] = sorted({int(i) for i in skip_blocks})
        if timestep_range is not None:
            cond_params["timestep_range"] = [float(timestep_range[0]), float(timestep_range[1])]
        parts = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(parts) == 2 and parts[1].numel() == 0:
            parts = parts[:1]
        steps = list(timestep) if isinstance(timestep, (list, tuple)) else [timestep]
        tensors = {f"x.{i}": _cpu(p) for i, p in enumerate(parts)}
        tensors.update({f"t.{i}": _cpu(t).float() for i, t in enumerate(steps[:2])})
        tensors.update(cond_tensors)
        device = parts[0].device
        receive = (lambda _name, t: t.to(device)) if device.type != "cpu" else None
        now = time.monotonic()
        if self.last_call is None or now - self.last_call > BUSY_WINDOW_S:
            self.run_since, self.run_calls = now, 0
        self.run_calls += 1
        self.last_call = now
        with self._lock:
            cid, new = self._context_id(context)
            for _ in range(_TRIES):
                self.sync_patches(*patches, check_interrupt=check_interrupt)
                params = {"context_id": cid, "frame_rate": float(frame_rate), "av_timestep": self.av_timestep,
                          "patches": self._pool_patches, **cond_params}
                send = dict(tensors)
                if new:
                    send["context"] = _cpu(context)
                    self.sent["context"] = self.sent.get("context", 0) + 1
                try:
                    result, out = self._request("forward", params, send, check_interrupt, receive)
                except BadInputError as e:
                    if e.reason == "unknown_context":
                        new = True
                    elif e.reason == "stale_patches":
                        self._pool_patches = None
                    elif e.reason == "no_model":
                        self._reloaded()
                        self._contexts.append((context, cid))
                        new = True
                    else:
                        raise
                    continue
                outs = [out[f"out.{i}"] for i in range(int(result["parts"]))]
                outs = [t.to(device) if t.device != device else t for t in outs]
                return outs if len(outs) == 2 else outs[0]  # ComfyUI's recombine: no audio -> the video tensor
            raise BadInputError(f"the pool could not run model '{self.name}' ({_TRIES} tries)")
