"""The transformer's weights sharded across the ranks (FSDP2, ``ltx_mgpu.denoise.parallel.fsdp``)
together with Ulysses sequence parallelism, on real gloo ranks:

* a deep tiny model (8 blocks, random weights) sharded over 2 and 4 ranks equals world size 1
  (video-only and audio-video, 45 video tokens: not divisible by the world size; a CFG batch
  with a self-attention mask); between calls each rank holds ~1/N of the weights, and while a
  block runs at most two blocks (it and the prefetched next one) are whole;
* through a real pool (the tiny LTX-2.3 checkpoint, fp32): a ``sharded`` load equals the
  ``replicated`` one on the MODEL path's forward and the SP Sampler (audio-video and video, LoRAs
  fused at load and ComfyUI patches merged into the shards, scale-only patches, a skipped block),
  at world sizes 2 and 4; the pool's
  status shows each rank's bytes of weights; the fit check's arithmetic and messages.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file
from sp_harness import reference, run_ranks

from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
from ltx_mgpu.client.model import PoolModel
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.denoise.checkpoint import CONNECTORS
from ltx_mgpu.denoise.comfyui.forward import processed_context
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.parallel.fsdp import HEADROOM, fit_error, weight_plan
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike

REL = 1e-5
DEEP = {"num_layers": 8}
AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7)
CASES = [
    dict(name="sharded_av_odd", **AV_ODD, model=DEEP, sharded=True),
    dict(name="sharded_video_odd", frames=3, height=3, width=5, model=DEEP, sharded=True, video_only=True),
    dict(name="sharded_av_cfg_mask", **AV_ODD, batch=2, attention_mask=True, model=DEEP, sharded=True),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world", [2, 4])
def test_a_deep_sharded_model_equals_world_size_one_and_holds_a_shard(tmp_path, world):
    reports = run_ranks(world, CASES, tmp_path)
    for case in CASES:
        ref_v, ref_a = reference(case)
        for r, report in enumerate(reports):
            entry = report[case["name"]]
            assert entry["error"] is None, entry["error"]
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert _rel(got["video"], ref_v) <= REL
            if ref_a is not None:
                assert _rel(got["audio"], ref_a) <= REL
            s = entry["sharding"]
            # between calls: about 1/N of the weights (FSDP pads each weight to N chunks)
            assert s["held_after"] <= s["total_bytes"] / world * 1.05 + 4096, s
            assert s["held_bytes"] == s["held_after"]
            # while a block runs: it, and at most the next one being prefetched
            assert len(s["gathered"]) == DEEP["num_layers"] and max(s["gathered"]) <= 2, s["gathered"]
            assert s["gathered"][0] == 2 and s["gathered"][-1] == 1


def test_the_fit_check_names_what_each_choice_needs():
    mib = 1 << 20
    shapes = {f"transformer_blocks.{i}.ff.weight": (256, 1024) for i in range(8)}  # 1 MiB each in bf16... x2
    shapes["proj_out.weight"] = (64, 1024)
    shapes[f"{CONNECTORS[0]}.x.weight"] = (16, 1024)
    plan = weight_plan(shapes, 2, 4, CONNECTORS)
    assert (plan.blocks, plan.largest_block, plan.root, plan.connectors) == (8 * 512 * 1024, 512 * 1024, 128 * 1024,
                                                                               32 * 1024)
    assert plan.per_rank("replicated") == 8 * 512 * 1024 + 160 * 1024
    assert plan.per_rank("sharded") == -(-(8 * 512 * 1024 + 128 * 1024) // 4) + 128 * 1024 + 2 * 512 * 1024 + 32 * 1024
    gpu = 100 * mib
    assert fit_error(plan, "replicated", gpu, gpu, "m") is None
    free = int(HEADROOM * gpu) + 3 * mib  # room for a shard (2.2 MiB), not a replica (4.2 MiB)
    msg = fit_error(plan, "replicated", free, gpu, "ltx.safetensors (bf16)")
    assert "ltx.safetensors (bf16) needs 0.0 GiB per GPU with weights 'replicated'" in msg
    assert "choose weights 'sharded'" in msg and "each of the 4 GPUs" in msg
    assert fit_error(plan, "sharded", free, gpu, "m") is None
    msg = fit_error(plan, "sharded", int(HEADROOM * gpu) + mib, gpu, "m")
    assert "neither fits" in msg


# --------------------------------------------------------------------------- through a pool


def _pool(base, ranks: int) -> PoolClient:
    return PoolClient.connect(gpus="cpu", nproc=ranks, runtime_dir=base, lifetime="with-owner",
                              startup_timeout=120)


def _lora_file(path, local) -> str:
    """A LoRA (ComfyUI naming) on a video self-attention and a feed-forward weight."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(4)
    params = dict(local.transformer.named_parameters())
    sd = {}
    for stem in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.0.proj"):
        o, i = params[f"{stem}.weight"].shape
        sd[f"diffusion_model.{stem}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"diffusion_model.{stem}.lora_B.weight"] = 0.5 * torch.randn(o, 2, generator=g)
    save_file(sd, str(path))
    return str(path)


def _cond(seed):
    t = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(seed))
    return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 24.0}]]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_sharded_load_equals_the_replicated_one_through_the_pool(base, tiny_ltx_23, tmp_path, ranks):
    local = load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))
    lora = _lora_file(tmp_path / "lora.safetensors", local)
    pool = _pool(base, ranks)
    try:
        loaded = {}
        for weights in ("replicated", "sharded"):
            for with_lora in (False, True):
                name = f"{weights}-{int(with_lora)}"
                plan = TransformerPlan(str(tiny_ltx_23), dtype="fp32", weights=weights,
                                       loras=[(lora, 0.7)] if with_lora else [])
                loaded[name] = remote_load_transformer(pool, plan, name=name, timeout=180)
        assert loaded["sharded-0"]["plan"]["weights"] == "sharded"
        assert loaded["replicated-0"]["plan"]["weights"] == "replicated"
        # the status shows what each rank holds: a shard ~1/N of the transformer (+ whole connectors)
        deadline = time.monotonic() + 30
        while True:  # each rank rewrites its status record after a job (and every second)
            ranks_info = pool.request("status", {}, timeout=30)[0]["ranks"]
            if all({"sharded-0", "replicated-0"} <= set(r["models"]) for r in ranks_info) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(ranks_info) == ranks
        for r in ranks_info:
            held, whole = r["models"]["sharded-0"]["bytes"], r["models"]["replicated-0"]["bytes"]
            assert r["models"]["sharded-0"]["plan"]["weights"] == "sharded"
            assert held < whole / ranks * 1.6, (held, whole)

        g = torch.Generator().manual_seed(3)
        x = [torch.randn(2, 128, 3, 3, 5, generator=g), torch.randn(2, 8, 7, 16, generator=g)]
        t = (torch.full((2,), 0.6), torch.full((2,), 0.6))
        ctx = torch.cat([processed_context(local, _cond(i)[0][0], True) for i in (1, 2)])
        q = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
        up, down = 0.5 * torch.randn(32, 2, generator=g), torch.randn(2, 32, generator=g)

        class Lora:
            name, weights = "lora", (up, down, None, None, None, None)

        patches = ("p1", {q: [(0.5, Lora(), 1.0, None, None)]})
        scaled = ("p2", {q: [(0.0, (None,), 1.3, None, None)]})  # an attention multiplier's patch
        outs = {}
        for name, res in loaded.items():
            pm = PoolModel(lambda: pool, lambda n=name: None, name=name, key=res["key"])
            outs[name] = {"av": pm.forward(x, t, ctx, frame_rate=24.0),
                          "video": pm.forward(x[0], t, ctx, frame_rate=24.0),
                          "patched": pm.forward(x, t, ctx, frame_rate=24.0, patches=patches),
                          "scaled": pm.forward(x, t, ctx, frame_rate=24.0, patches=scaled),
                          "skipped": pm.forward(x, t, ctx, frame_rate=24.0, skip_blocks=[0])}  # skip-layer guidance
            pm.sync_patches("none", {})
        for lora_on in (0, 1):
            rep, sh = outs[f"replicated-{lora_on}"], outs[f"sharded-{lora_on}"]
            for case in ("av", "video", "patched", "scaled", "skipped"):
                a = rep[case] if isinstance(rep[case], list) else [rep[case]]
                b = sh[case] if isinstance(sh[case], list) else [sh[case]]
                assert all(_rel(p, q_) <= REL for p, q_ in zip(b, a)), (lora_on, case)
        assert _rel(outs["sharded-1"]["av"][0], outs["sharded-0"]["av"][0]) > 1e-3  # the LoRA did something
        assert _rel(outs["sharded-0"]["patched"][0], outs["sharded-0"]["av"][0]) > 1e-4
        assert _rel(outs["sharded-0"]["scaled"][0], outs["sharded-0"]["av"][0]) > 1e-4
        assert _rel(outs["sharded-0"]["skipped"][0], outs["sharded-0"]["av"][0]) > 1e-3

        latent = {"samples": NestedTensorLike([torch.zeros(1, 128, 3, 3, 5), torch.zeros(1, 8, 7, 16)]),
                  "type": "audio"}
        sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0])
        got = {w: remote_sample(pool, SampleRequest(_cond(1), _cond(2), latent, model=f"{w}-1", cfg=3.0, seed=5,
                                                    sigmas=sigmas), timeout=180) for w in ("replicated", "sharded")}
        for a, b in zip(got["sharded"]["samples"].tensors, got["replicated"]["samples"].tensors):
            assert _rel(a, b) <= REL
    finally:
        pool.shutdown()


def test_a_sharded_bf16_load_holds_bf16_shards(base, tiny_ltx_23):
    """The shards are in the compute dtype, as a replicated load's weights (not float32)."""
    pool = _pool(base, 2)
    try:
        rep = remote_load_transformer(pool, TransformerPlan(str(tiny_ltx_23), dtype="bf16"), name="rep", timeout=180)
        sh = remote_load_transformer(pool, TransformerPlan(str(tiny_ltx_23), dtype="bf16", weights="sharded"),
                                     name="sh", timeout=180)
        assert sh["bytes"] < rep["bytes"] * 0.75, (sh["bytes"], rep["bytes"])
        g = torch.Generator().manual_seed(3)
        x = [torch.randn(1, 128, 3, 3, 5, generator=g).bfloat16(), torch.randn(1, 8, 7, 16, generator=g).bfloat16()]
        t = (torch.full((1,), 0.6), torch.full((1,), 0.6))
        ctx = torch.randn(1, 1024, sum(sh["context_widths"]), generator=g).bfloat16()
        outs = [PoolModel(lambda: pool, lambda: None, n, key=r["key"]).forward(x, t, ctx) for n, r in
                (("rep", rep), ("sh", sh))]
        assert all(o.dtype == torch.bfloat16 for o in outs[1])
        assert all(_rel(a.float(), b.float()) <= 1e-2 for a, b in zip(outs[1], outs[0]))
    finally:
        pool.shutdown()
