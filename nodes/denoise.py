"""Denoising nodes: the LTX-2 transformer on every GPU of the pool, sequence-parallel sampling.

* **Model Loader** (``LTXMGPU_ModelLoader``) -> ``LTXMGPU_MODEL``, ``MODEL``, ``VAE``: a
  checkpoint from ``models/checkpoints`` (monolith) or ``models/diffusion_models`` (transformer
  only), dtype, LoRAs from ``models/loras`` (one ``file:strength`` per line), max tokens. Loads
  on every rank (a full replica each; sequence parallelism splits the tokens, not the weights).
  ``MODEL`` is ComfyUI's own type over that transformer (``nodes._model``): ComfyUI's samplers,
  guiders, schedulers and LoRA loaders use it unchanged while the pool runs the model; ``VAE``
  is the checkpoint's video VAE, loaded in ComfyUI as ``CheckpointLoaderSimple`` loads it (None
  for a file without one), so a template's ``CheckpointLoaderSimple`` is replaced by this node.
* **SP Sampler** (``LTXMGPU_SPSampler``): model, positive / negative CONDITIONING, a ComfyUI
  LTX-2 LATENT (video, audio, or the audio-video NestedTensor of ``LTXVConcatAVLatent``),
  optional SIGMAS (``LTXVScheduler``, ``ManualSigmas``; else ``steps`` of the LTX-2 scheduler),
  cfg, seed, sampler -> the denoised LATENT in the same structure, so ``LTXVSeparateAVLatent``,
  ``VAEDecode`` and ``LTXVAudioVAEDecode`` take it unchanged. Noise is drawn as ComfyUI draws it
  (CPU generator from the seed, video then audio).
"""

from __future__ import annotations

from dataclasses import dataclass

from ltx_mgpu.choices import SAMPLERS, SP_LAYOUTS, TRANSFORMER_COMPILE, TRANSFORMER_WEIGHTS
from ltx_mgpu.choices import TRANSFORMER_DTYPES as DTYPES
from ltx_mgpu.denoise.plan import DEFAULT_MAX_TOKENS, TransformerPlan

from . import _comfy, _model
from ._comfy import io
from ._runtime import CATEGORY, JobWatch, ModelType, PoolHandle, PoolType, executing_node

MODEL_FOLDERS = ("checkpoints", "diffusion_models")


def checkpoint_choices() -> list[str]:
    """LTX-2 checkpoints (``models/checkpoints``), then transformer-only files and GGUF
    transformers (``models/diffusion_models`` and ``models/unet``, where ComfyUI-GGUF's
    ``UnetLoaderGGUF`` reads them)."""
    seen: list[str] = []
    lists = [_comfy.filename_list(f) for f in MODEL_FOLDERS] + [_comfy.filename_list("diffusion_models", (".gguf",))]
    for names in lists:
        seen += [f for f in names if f not in seen]
    return seen


def _in_folders(name: str, folders: tuple[str, str], what: str) -> str:
    """Absolute path of ``name`` in the first of the two ComfyUI model ``folders`` that has it.

    Raises:
        FileNotFoundError: in neither (the message names ``what`` and both folders).
    """
    for folder in folders:
        try:
            return _comfy.full_path(folder, name)
        except FileNotFoundError:
            pass
    raise FileNotFoundError(f"{what} {name!r} is in neither models/{folders[0]} nor models/{folders[1]}; pick one "
                            "from the list")


def resolve_checkpoint(name: str) -> str:
    """Absolute path of a :func:`checkpoint_choices` entry (checkpoints first) or absolute path.

    Raises:
        FileNotFoundError: in neither folder.
    """
    return _in_folders(name, ("checkpoints", "diffusion_models"), "LTX-2 checkpoint")


#: The ``connectors`` choice that keeps the checkpoint's own text connectors.
OWN_CONNECTORS = "(the checkpoint's own)"


def connector_choices() -> list[str]:
    """The Model Loader's ``connectors`` choices: the checkpoint's own, then the files that may
    hold LTX-2's text connectors: ``models/text_encoders`` (where ComfyUI's LTX-2.0
    embeddings-connector files go, beside Gemma) and ``models/checkpoints``."""
    seen = [OWN_CONNECTORS]
    for folder in ("text_encoders", "checkpoints"):
        seen += [f for f in _comfy.filename_list(folder) if f.endswith(".safetensors") and f not in seen]
    return seen


def resolve_connectors(name: str) -> str | None:
    """None for :data:`OWN_CONNECTORS`, else the absolute path of a :func:`connector_choices` file.

    Raises:
        FileNotFoundError: in neither folder.
    """
    if name == OWN_CONNECTORS:
        return None
    return _in_folders(name, ("text_encoders", "checkpoints"), "connectors file")


def parse_loras(text: str) -> list[tuple[str, float]]:
    """``file[:strength]`` per line (``#`` comments and empty lines skipped) -> ``[(path, strength)]``;
    files are looked up in ``models/loras`` unless absolute; strength defaults to 1.0.

    Raises:
        ValueError: a strength that is not a number. FileNotFoundError: an unknown LoRA file.
    """
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, strength = line, 1.0
        head, sep, tail = line.rpartition(":")
        if sep and head and "/" not in tail:
            try:
                name, strength = head.strip(), float(tail)
            except ValueError:
                raise ValueError(f"LoRA line {n} {raw.strip()!r}: strength {tail.strip()!r} is not a number; "
                                 "write file.safetensors:0.8") from None
        out.append((_comfy.full_path("loras", name), strength))
    return out


@dataclass(frozen=True)
class ModelHandle:
    """The ``LTXMGPU_MODEL`` value: the pool and the transformer's plan (the sampler re-sends
    it, so a model freed or a pool restarted since is loaded again)."""

    pool: PoolHandle
    plan: TransformerPlan

    def ensure_loaded(self, session, watch: JobWatch | None = None) -> dict:
        """Load (or keep, when unchanged) the transformer on every rank; the load result."""
        from ltx_mgpu.client.denoise import remote_load_transformer

        if watch is None:
            return remote_load_transformer(session, self.plan)
        with watch.phase("load_transformer"):  # a load reports no steps: the node shows its elapsed time
            return remote_load_transformer(session, self.plan, should_cancel=watch.should_cancel)

    def comfy_model(self, loaded: dict):
        """ComfyUI's ``MODEL`` over this transformer (``nodes._model``; ``loaded``: the load's
        result), or None without ComfyUI. When the pool has lost the model (restarted, freed,
        another loaded under its name) the MODEL's next call loads it again."""
        if _comfy.comfy_module("comfy.model_patcher") is None:
            return None
        from ltx_mgpu.client.model import PoolModel

        pool_model = PoolModel(lambda: self.pool.client, lambda: self.ensure_loaded(self.pool.client),
                               name=loaded["model"], key=loaded.get("key"))
        return _model.pool_model_patcher(pool_model, self.plan.checkpoint, self.plan.compute_dtype)

    def comfy_vae(self):
        """The checkpoint's video VAE as ComfyUI's ``VAE`` (its ``vae.`` tensors only), or None
        without ComfyUI or for a file without one."""
        return _model.checkpoint_vae(self.plan.checkpoint) if _comfy.comfy_module("comfy.sd") is not None else None


class LTXMGPUModelLoader(io.ComfyNode):
    """-> ``LTXMGPU_MODEL`` after the transformer is resident on every rank. Raises
    FileNotFoundError (checkpoint, LoRA), ValueError (LoRA line), BadInputError (the pool
    refused: format, heads not divisible by the GPU count...)."""

    @classmethod
    def define_schema(cls):
        choices = checkpoint_choices()
        return io.Schema(
            node_id="LTXMGPU_ModelLoader",
            display_name="LTX-2 Multi-GPU Model Loader",
            category=CATEGORY,
            description=("Loads the LTX-2 transformer (and its text connectors, LoRAs fused) on every GPU of the pool "
                         "for sequence-parallel sampling. Loading the same files again keeps the loaded model."),
            inputs=[
                PoolType.Input("pool", tooltip="The pool to load the transformer into (from the Pool node)."),
                io.Combo.Input("ckpt_name", options=choices, default=choices[0] if choices else None, tooltip=(
                    "LTX-2 checkpoint: the single file from models/checkpoints (ltx-2*.safetensors), a "
                    "transformer-only file from models/diffusion_models, or a GGUF transformer from "
                    "models/unet or models/diffusion_models (as UnetLoaderGGUF reads them; its quantized "
                    "blocks stay quantized on the GPUs). Every GPU loads a full copy, or its shard (weights).")),
                io.Combo.Input("dtype", options=list(DTYPES), default="bf16", tooltip=(
                    "Compute and weight dtype of the transformer in the pool (bf16 is the model's own; fp32 only "
                    "for checks on small models). fp8: the blocks' large linears as e4m3 GEMMs on FP8 tensor "
                    "cores (Ada, Hopper or newer GPUs), the rest bf16: faster, a few percent off bf16's result; "
                    "the first run at each size compiles for minutes.")),
                io.String.Input("loras", multiline=True, default="", tooltip=(
                    "LoRAs from models/loras, one per line as file.safetensors:strength (strength 1.0 if "
                    "omitted); fused into the weights at load.")),
                io.Int.Input("max_tokens", default=DEFAULT_MAX_TOKENS, min=64, max=1 << 20, step=64, tooltip=(
                    "Largest number of video latent tokens the sampler accepts ((frames-1)/8+1) x (height/32) x "
                    "(width/32); 121 frames at 1280x704 are 14080. It bounds the audio tokens too (25 per second, "
                    "reference audio included). A larger latent is refused with a clear message.")),
                io.Combo.Input("weights", options=list(TRANSFORMER_WEIGHTS), default="replicated", optional=True,
                               tooltip=(
                    "replicated: every GPU holds the whole transformer (fastest). sharded: each GPU holds 1/N of "
                    "every weight and gathers each block just before it runs (FSDP), so a model too big for one "
                    "GPU fits on several (e.g. LTX-2.3 22B on four 24 GB cards); a little slower per step.")),
                io.Combo.Input("layout", options=list(SP_LAYOUTS), default="auto", optional=True, tooltip=(
                    "How each model call is split over the GPUs. A call carries the guidance passes ComfyUI "
                    "batches (cond + uncond for CFG, three for DualCFGGuider or a perturbed pass). ulysses: the "
                    "video tokens over all GPUs. auto: the passes over groups of GPUs, each group splitting the "
                    "tokens, whenever they split evenly (2 passes on an even GPU count, 4 on 4 GPUs one each): "
                    "the same work per GPU, less communication; else ulysses. cfg_ulysses: any batch of 2 or "
                    "more on two halves of the GPUs, unevenly for an odd one (pays only on slow GPU links).")),
                io.Combo.Input("connectors", options=connector_choices(), default=OWN_CONNECTORS, optional=True,
                               tooltip=(
                    "Where the text connectors come from. A transformer file without them (the LTX-2.0 GGUF "
                    "files) needs the file that has them: the embeddings-connector file from "
                    "models/text_encoders (ltx-2-19b-embeddings_connector_*.safetensors, the one DualCLIPLoader "
                    "takes beside Gemma) or the full checkpoint.")),
                io.Combo.Input("compile", options=list(TRANSFORMER_COMPILE), default="auto", optional=True,
                               tooltip=(
                    "auto: dtype fp8 runs its transformer blocks compiled (torch.compile), every other dtype "
                    "eagerly, as ComfyUI's own model runs. on: compiled in every dtype, faster per step on a GPU; "
                    "the first run at each size compiles first (kept in the compile cache for later pools), and "
                    "the result differs from eager by rounding. Not for GGUF or nvfp4 / int8 files.")),
            ],
            outputs=[
                ModelType.Output("model", tooltip="The LTX-2 transformer resident in the pool; connect it to the SP "
                                                  "Sampler."),
                io.Model.Output("comfy_model", tooltip=(
                    "The same transformer as ComfyUI's MODEL: connect it where a template takes "
                    "CheckpointLoaderSimple's MODEL (CFGGuider, KSampler, LoraLoaderModelOnly, ...). ComfyUI runs "
                    "its own sampler; every model call runs in the pool, sequence-parallel over its GPUs.")),
                io.Vae.Output("vae", tooltip=(
                    "The checkpoint's video VAE (as CheckpointLoaderSimple gives it), for VAEDecode / "
                    "LTXVImgToVideo.")),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, pool: PoolHandle, ckpt_name: str, dtype: str, loras: str, max_tokens: int,
                weights: str = "replicated", layout: str = "auto", connectors: str = OWN_CONNECTORS,
                compile: str = "auto") -> io.NodeOutput:
        plan = TransformerPlan(resolve_checkpoint(ckpt_name), dtype=dtype, weights=weights, layout=layout,
                               loras=parse_loras(loras), max_tokens=int(max_tokens),
                               connectors=resolve_connectors(connectors), compile=compile)
        handle = ModelHandle(pool, plan)
        with JobWatch(executing_node(cls)) as watch:
            loaded = handle.ensure_loaded(pool.session(), watch)
            watch.done()
        return io.NodeOutput(handle, handle.comfy_model(loaded), handle.comfy_vae())


class LTXMGPUSPSampler(io.ComfyNode):
    """-> LATENT: a copy of the input with denoised ``samples`` (nested parts rebuilt as ComfyUI's
    NestedTensor, input dtype). Raises BadInputError (not an LTX-2 latent, too many tokens,
    unsupported conditioning keys), ComfyUI's interrupt on Stop."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_SPSampler",
            display_name="LTX-2 Multi-GPU SP Sampler",
            category=CATEGORY,
            description=("Samples an LTX-2 latent with the transformer split across the pool's GPUs (sequence "
                         "parallel); same result as one GPU up to floating-point order. Stop ends it within a step."),
            inputs=[
                ModelType.Input("model", tooltip="The LTX-2 transformer in the pool (from the Model Loader)."),
                io.Conditioning.Input("positive", tooltip=(
                    "LTX-2 conditioning (Prompt Encode, optionally through LTXVConditioning for the frame rate).")),
                io.Conditioning.Input("negative", tooltip="Negative conditioning (unused when cfg is 1)."),
                io.Latent.Input("latent", tooltip=(
                    "ComfyUI LTX-2 latent: EmptyLTXVLatentVideo, LTXVEmptyLatentAudio, or both through "
                    "LTXVConcatAVLatent (a noise_mask from image-to-video nodes is honoured).")),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip=(
                    "Denoising steps of the LTX-2 scheduler (shift from the latent's token count). Ignored when "
                    "sigmas are connected.")),
                io.Float.Input("cfg", default=3.0, min=0.0, max=100.0, step=0.1, round=0.01, tooltip=(
                    "Classifier-free guidance scale; 1 skips the negative pass (distilled models).")),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True, tooltip=(
                    "Noise seed; the same seed gives the same noise as ComfyUI's RandomNoise.")),
                io.Combo.Input("sampler", options=list(SAMPLERS), default=SAMPLERS[0], tooltip=(
                    "Sampler run in the pool (flow-matching Euler).")),
                io.Sigmas.Input("sigmas", optional=True, tooltip=(
                    "Optional noise schedule (LTXVScheduler, ManualSigmas, ...); replaces steps.")),
            ],
            outputs=[io.Latent.Output("latent", tooltip=(
                "The denoised latent, same structure as the input (decode with LTXVSeparateAVLatent, VAEDecode, "
                "LTXVAudioVAEDecode)."))],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: ModelHandle, positive, negative, latent, steps: int, cfg: float, seed: int,
                sampler: str, sigmas=None) -> io.NodeOutput:
        from ltx_mgpu.client.denoise import SampleRequest, remote_sample

        session = model.pool.session()
        with JobWatch(executing_node(cls)) as watch:
            loaded = model.ensure_loaded(session, watch)
            request = SampleRequest(positive, negative if float(cfg) != 1.0 else None, latent, model=loaded["model"],
                                    sigmas=sigmas, steps=None if sigmas is not None else int(steps), cfg=float(cfg),
                                    seed=int(seed), sampler=sampler)
            out = remote_sample(session, request, on_progress=watch.on_progress, should_cancel=watch.should_cancel)
        return io.NodeOutput(_comfy.to_comfy_latent(out))


NODES = (LTXMGPUModelLoader, LTXMGPUSPSampler)
