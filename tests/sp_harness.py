"""Test helper for sequence parallelism: a tiny random LTX-2 transformer, deterministic
inputs, and a launcher that runs real gloo ranks as separate processes (like torchrun).

Ranks are plain ``python tests/sp_harness.py`` subprocesses; the case list goes in as JSON
and the outputs come back as safetensors files plus a JSON report per rank (nothing is
pickled either way). The parent test computes the world-size-1 reference itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)
from ltx_core.model.transformer import LTXModelConfigurator, LTXVideoOnlyModelConfigurator, Modality
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape
from rank_support import run_rank_processes

VIDEO_HEADS, VIDEO_HEAD_DIM = 4, 8
AUDIO_HEADS, AUDIO_HEAD_DIM = 4, 4
CHANNELS = 128
CONTEXT_TOKENS = 6
RANK_TIMEOUT_S = 120


def tiny_config(**overrides) -> dict:
    """ltx-core 1.0.0 config dict of a 2-layer LTX-2.3-layout AV transformer (its model_configurator.py)."""
    t = {
        "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None,
        "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
        "use_linear_projection": False, "only_cross_attention": False,
        "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
        "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
        "positional_embedding_type": "rope", "use_audio_video_cross_attention": True,
        "share_ff": False, "av_cross_ada_norm": True, "use_middle_indices_grid": True,
        "num_attention_heads": VIDEO_HEADS, "attention_head_dim": VIDEO_HEAD_DIM,
        "in_channels": CHANNELS, "out_channels": CHANNELS, "num_layers": 2,
        "cross_attention_dim": VIDEO_HEADS * VIDEO_HEAD_DIM,
        "audio_num_attention_heads": AUDIO_HEADS, "audio_attention_head_dim": AUDIO_HEAD_DIM,
        "audio_in_channels": CHANNELS, "audio_out_channels": CHANNELS,
        "audio_cross_attention_dim": AUDIO_HEADS * AUDIO_HEAD_DIM,
        "rope_type": "split", "frequencies_precision": "float64",
        "apply_gated_attention": True, "cross_attention_adaln": True,
        "caption_proj_before_connector": True, "attention_type": "pytorch",
    }
    t.update(overrides)
    return {"transformer": t}


def build_tiny_model(seed: int = 0, video_only: bool = False, **overrides):
    """Build under meta, ``to_empty``, then fill every parameter from a seeded generator (fp32)."""
    configurator = LTXVideoOnlyModelConfigurator if video_only else LTXModelConfigurator
    with torch.device("meta"):
        model = configurator.from_config(tiny_config(**overrides))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def make_inputs(frames, height, width, audio_tokens=0, batch=1, seed=1, attention_mask=False,
                context_widths=(VIDEO_HEADS * VIDEO_HEAD_DIM, AUDIO_HEADS * AUDIO_HEAD_DIM), timesteps="i2v"):
    """Deterministic ``(video, audio|None)`` Modalities. ``timesteps``: ``"i2v"`` (default) the
    first latent frame is 'conditioned' (timestep 0), like image-to-video; ``"uniform"`` every
    token at its sample's sigma, per token (``[B, T]``); ``"per_sample"`` the same sigmas as
    ``[B, 1]`` (what a ComfyUI ``[B]`` timestep reaches ltx-core as). Positions come from
    ltx-core's latent tools at 25 fps. ``context_widths``: the (video, audio) text context widths
    (the model's cross-attention dims)."""
    if timesteps not in ("i2v", "uniform", "per_sample"):
        raise ValueError(f"timesteps {timesteps!r}: use i2v, uniform or per_sample")
    gen = torch.Generator().manual_seed(seed)
    vshape = VideoLatentShape(batch, CHANNELS, frames, height, width)
    vstate = VideoLatentTools(VideoLatentPatchifier(1), vshape, fps=25.0).create_initial_state("cpu", torch.float32)
    t = frames * height * width
    sigma = torch.rand(batch, generator=gen) * 0.8 + 0.1
    mask = torch.ones(batch, t)
    if timesteps == "i2v":
        mask[:, : height * width] = 0.0
    vmask = torch.rand(batch, t, t, generator=gen) if attention_mask else None
    video = Modality(
        latent=torch.randn(batch, t, CHANNELS, generator=gen),
        sigma=sigma,
        timesteps=sigma[:, None].clone() if timesteps == "per_sample" else mask * sigma[:, None],
        positions=vstate.positions,
        context=torch.randn(batch, CONTEXT_TOKENS, context_widths[0], generator=gen),
        attention_mask=vmask,
    )
    audio = None
    if audio_tokens:
        ashape = AudioLatentShape(batch, 8, audio_tokens, 16)
        astate = AudioLatentTools(AudioPatchifier(1), ashape).create_initial_state("cpu", torch.float32)
        audio = Modality(
            latent=torch.randn(batch, audio_tokens, CHANNELS, generator=gen),
            sigma=sigma,
            timesteps=sigma[:, None].expand(batch, 1 if timesteps == "per_sample" else audio_tokens).clone(),
            positions=astate.positions,
            context=torch.randn(batch, CONTEXT_TOKENS, context_widths[1], generator=gen),
        )
    return video, audio


def make_perturbations(kind: str | None, batch: int):
    """None, or a batch where sample 0 skips video self-attention in block 1 and every
    sample skips video->audio cross-attention in block 0 (partial and full skips)."""
    if kind is None:
        return None
    assert kind == "mixed"
    configs = [
        PerturbationConfig([
            Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1]) if i == 0 else
            Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [1]),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, [0]),
        ])
        for i in range(batch)
    ]
    return BatchedPerturbationConfig(configs)


def run_case(model_forward, case: dict):
    """Run one case dict through ``model_forward(video, audio, perturbations)``."""
    video, audio = make_inputs(
        case["frames"], case["height"], case["width"], case.get("audio_tokens", 0),
        case.get("batch", 1), case.get("seed", 1), case.get("attention_mask", False),
        *([tuple(case["context_widths"])] if "context_widths" in case else []),
        timesteps=case.get("timesteps", "i2v"),
    )
    return model_forward(video, audio, make_perturbations(case.get("perturbations"), case.get("batch", 1)))


def _inputs_for(case: dict):
    """``(video, perturbations)`` of ``case``, to ask the SP model which layout it takes."""
    video, _ = make_inputs(case["frames"], case["height"], case["width"], case.get("audio_tokens", 0),
                           case.get("batch", 1), case.get("seed", 1), case.get("attention_mask", False),
                           timesteps=case.get("timesteps", "i2v"))
    return video, make_perturbations(case.get("perturbations"), case.get("batch", 1))


def fp8_compute(model) -> None:
    """Make the block linears of a tiny model e4m3 GEMM layers (``ltx_mgpu.denoise.fp8``; CPU
    torch runs ``_scaled_mm``): every one whose sizes are multiples of 16 (the tiny model is below
    the production minimum size)."""
    from ltx_mgpu.denoise.fp8 import fp8_linear_names, swap_linears
    from ltx_mgpu.denoise.plan import Fp8Config

    names = [n for n in fp8_linear_names(model, compute=False)
             if all(d % 16 == 0 for d in model.get_submodule(n).weight.shape)]
    swap_linears(model, Fp8Config("fp8"), names)


def reference(case: dict):
    """The world-size-1 output of ``case`` (plain ltx-core model; fp8 compute layers, compiled,
    with ``fp8_compute``)."""
    from ltx_mgpu.denoise.fp8 import compile_blocks

    model = build_tiny_model(video_only=case.get("video_only", False), **case.get("model", {}))
    if case.get("fp8_compute"):
        fp8_compute(model)
        compile_blocks(model, dynamic=False)
    with torch.no_grad():
        return run_case(model, case)


# --------------------------------------------------------------------------- multi-process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, cases: list[dict], out_dir: Path, timeout: float = RANK_TIMEOUT_S) -> list[dict]:
    """Run ``cases`` on ``world`` gloo ranks (one subprocess each); returns each rank's report.

    A report maps case name -> {"error": str | None}; outputs are in
    ``out_dir/rank{r}_{name}.safetensors`` with keys ``video`` / ``audio``.
    """
    out_dir = Path(out_dir)
    spec = out_dir / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "port": free_port(), "world": world}))
    run_rank_processes(__file__, str(spec), world, timeout=timeout)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _watch_shards(model, total: int) -> dict:
    """``{"total_bytes", "held_bytes", "gathered"}`` of a sharded ``model``: ``gathered`` fills
    with how many blocks are whole as each block starts (``ltx_mgpu.denoise.parallel.fsdp``)."""
    from ltx_mgpu.denoise.parallel.fsdp import gathered_blocks, held_bytes

    gathered: list[int] = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, _a, g=gathered: g.append(gathered_blocks(model)))
    return {"total_bytes": total, "held_bytes": held_bytes(model), "gathered": gathered}


def _block_tokens(model) -> list[int]:
    """The video token counts the first block of ``model`` sees from now on (per GPU; the hook
    is taken off at the next call of this function on the same model)."""
    seen: list[int] = []
    old = getattr(model, "_harness_tokens_hook", None)
    if old is not None:
        old.remove()
    model._harness_tokens_hook = model.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(int(kwargs["video"].x.shape[1])) if kwargs.get("video") else None,
        with_kwargs=True)
    return seen


@contextlib.contextmanager
def _counting_gathers():
    """Count the bytes FSDP2's all-gathers deliver to this rank while the block runs (its
    ``all_gather_single``, or ``all_gather_into_tensor`` on a torch without it): ``{"bytes"}``."""
    import torch.distributed as dist

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original, traffic = getattr(dist, name), {"bytes": 0}

    def counted(output, *args, **kwargs):
        traffic["bytes"] += output.numel() * output.element_size()
        return original(output, *args, **kwargs)

    setattr(dist, name, counted)
    try:
        yield traffic
    finally:
        setattr(dist, name, original)


def _rank_main(spec_path: str, rank: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from ltx_mgpu.denoise.fp8 import compile_blocks
    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.denoise.parallel.buckets import TokenBuckets
    from ltx_mgpu.denoise.parallel.fsdp import held_bytes, shard_transformer
    from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer
    from ltx_mgpu.denoise.plan import TransformerPlan

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec_path).parent
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=60))
    report = {}
    models, shards = {}, {}
    for case in spec["cases"]:
        name = case["name"]
        sharded = case.get("sharded", False)
        key = json.dumps([case.get("video_only", False), case.get("model", {}), sharded, case.get("checkpoint"),
                          case.get("fp8_compute", False)], sort_keys=True)
        if key not in models and case.get("checkpoint"):  # a file, loaded as the pool loads it
            total = held_bytes(load_ltx_model(TransformerPlan(case["checkpoint"], dtype="fp32")).transformer)
            plan = TransformerPlan(case["checkpoint"], dtype="fp32", weights="sharded" if sharded else "replicated")
            models[key] = load_ltx_model(plan, group=dist.group.WORLD).transformer
            shards[key] = _watch_shards(models[key], total)
        if key not in models:
            models[key] = build_tiny_model(video_only=case.get("video_only", False), **case.get("model", {}))
            if case.get("fp8_compute"):
                fp8_compute(models[key])
            if sharded:  # FSDP2 over the same ranks (ltx_mgpu.denoise.parallel.fsdp)
                total = held_bytes(models[key])
                shard_transformer(models[key], dist.group.WORLD, torch.device("cpu"))
                shards[key] = _watch_shards(models[key], total)
            if case.get("fp8_compute"):
                compile_blocks(models[key], dynamic=False)  # after sharding, as the loader does
        try:
            sp = SequenceParallelTransformer(models[key], None, case.get("max_tokens", 4096),
                                             layout=case.get("layout", "ulysses"),
                                             buckets=TokenBuckets(*case["buckets"]) if "buckets" in case else None,
                                             _mask_v2a_keys=case.get("mask_v2a", True))
            seen = _block_tokens(models[key])
            with torch.no_grad(), _counting_gathers() as traffic:
                vx, ax = run_case(sp, case)
        except ValueError as e:  # SequenceParallelConfigError is a ValueError
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        tensors = {"video": vx.contiguous()}
        if ax is not None:
            tensors["audio"] = ax.contiguous()
        save_file(tensors, str(out_dir / f"rank{rank}_{name}.safetensors"))
        report[name] = {"error": None, "samples": list(sp.layout_for(_inputs_for(case)[0]).samples),
                        "block_tokens": list(seen),
                        "gathered_bytes": traffic["bytes"],
                        **({"sharding": dict(shards[key], gathered=list(shards[key]["gathered"]),
                                                          held_after=held_bytes(models[key]))} if sharded else {})}
        if sharded:
            shards[key]["gathered"].clear()
    # the group must still be healthy after any error: one collective every rank reaches
    token = torch.ones(1)
    dist.all_reduce(token)
    report["_all_reduce"] = token.item()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
    # Skip interpreter finalisation: gloo's background threads can abort a rank in static
    # destructors after the group is destroyed (seen in tests/integration/test_agree.py under load); the
    # results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
