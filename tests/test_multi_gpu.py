"""The pool on two real GPUs (one process per GPU, NCCL for the data): every Gemma placement, bf16
and NF4, gives the in-process embeddings and leaves them on both ranks; sequence-parallel
sampling across the two GPUs equals the in-process sampler; ``generate --gpus 2`` writes its
video from GPU ranks. The CPU suite runs the same code paths on gloo ranks
(``test_text_pool.py``, ``test_denoise_pool.py``); this file is what only a machine with two
GPUs can check (run on ``nvidia-h200-x2``, skipped elsewhere with the reason)."""

from __future__ import annotations

import pytest
import torch
from pool_support import cleanup, short_dir
from text_pool_support import PROMPTS, check, encode

from ltx_mgpu.cli.main import main
from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.denoise.comfyui.sampler import sample
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.local import LocalTextEncoder

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs two CUDA GPUs (torch sees {torch.cuda.device_count()})")]


@pytest.fixture(scope="module")
def gpu_pool():
    base = short_dir()
    client = PoolClient.connect(gpus=[0, 1], runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        yield client
    finally:
        client.shutdown()
        client.close()
        cleanup(base)


def test_the_pool_runs_one_rank_per_gpu_on_nccl(gpu_pool):
    result, _ = gpu_pool.request("selftest", {"steps": 1}, timeout=120)
    assert result["allreduce_ok"] and result["world_size"] == 2
    devices = [r["device"] for r in gpu_pool.status()["ranks"]]
    assert devices == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("weights", ["bf16", "nf4"])
@pytest.mark.parametrize("placement", ["single", "accelerate", "batch_parallel"])
def test_each_placement_on_two_gpus_gives_the_in_process_embeddings(gpu_pool, tiny_gemma_dir, checkpoints,
                                                                     placement, weights):
    """float32 compute for bf16 weights (one prompt at a time in-process: fp32 results do not
    depend on the batch), bf16 compute for NF4 in the pool's own sub-batches ([0, 1], [2])."""
    dtype = "float32" if weights == "bf16" else "bfloat16"
    encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], weights=weights, placement=placement, dtype=dtype)
    result, tensors = encode(gpu_pool, encoder, PROMPTS[:3], batch_size=2)
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], weights, dtype=dtype), "cuda:0")
    if weights == "bf16":
        ref = [spec.build().encode([p])[0] for p in PROMPTS[:3]]
    else:
        ref = spec.build().encode(PROMPTS[:3], batch_size=2)
    check(result, tensors, ref, world_size=2)
    te = gpu_pool.status()["ranks"][0]["models"]["text_encoder"]
    assert te["placement"] == placement and te["weights"] == weights
    if placement == "accelerate":  # Accelerate's device_map gave both GPUs layers
        assert len(te["layers"]) == 2 and all(te["layers"].values()), te


def _sp_inputs():
    g = torch.Generator().manual_seed(3)
    cond = [[torch.randn(1, 9, 48, generator=g), {"pooled_output": None, "unprocessed_ltxav_embeds": True,
                                                   "frame_rate": 24.0}]]
    neg = [[torch.randn(1, 5, 48, generator=g), {"pooled_output": None, "unprocessed_ltxav_embeds": True,
                                                  "frame_rate": 24.0}]]
    from ltx_mgpu.nested import NestedTensorLike

    latent = {"samples": NestedTensorLike([torch.randn(1, 128, 3, 4, 6, generator=g),
                                           torch.randn(1, 8, 7, 16, generator=g)]), "type": "audio"}
    return cond, neg, latent


def test_sequence_parallel_sampling_on_two_gpus_equals_the_in_process_sampler(gpu_pool, tiny_ltx_23):
    loaded = remote_load_transformer(gpu_pool, TransformerPlan(str(tiny_ltx_23), dtype="fp32"))
    assert loaded["world_size"] == 2
    cond, neg, latent = _sp_inputs()
    got = remote_sample(gpu_pool, SampleRequest(cond, neg, latent, cfg=3.0, seed=5, steps=3), timeout=300)
    ref = sample(load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32")), cond, neg, latent, cfg=3.0, seed=5,
                                                steps=3)
    for x, y, start in zip(got["samples"].tensors, ref["samples"].tensors, latent["samples"].tensors):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() <= 1e-4  # GPU vs CPU float32
        assert (x - start).abs().max().item() > 0.1  # it did denoise
    gpu_pool.request("unload", {"names": None}, timeout=120)


@pytest.mark.parametrize("weights", ["replicated", "sharded"])
def test_a_forward_cancelled_between_blocks_on_two_gpus_leaves_the_model_as_it_was(gpu_pool, tmp_path, weights):
    """A MODEL-path forward long enough to cancel midway (an 8-block, 1024-wide model, 131,072
    video tokens over NCCL, bf16) stops at a block boundary on both GPUs (``JobCancelledError``);
    with FSDP2-sharded weights and their CUDA streams, the next call gives what a call gave before
    (the CPU suite checks the same on gloo: ``test_hostile.py``)."""
    import json
    import time
    import uuid

    from safetensors.torch import save_file
    from sp_harness import build_tiny_model, tiny_config

    from ltx_mgpu.client.errors import JobCancelledError
    from ltx_mgpu.client.model import PoolModel

    shape = {"num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 128, "cross_attention_dim": 1024}
    path = tmp_path / "medium.safetensors"
    model = build_tiny_model(**shape)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"config": json.dumps(tiny_config(**shape))})
    del model
    plan = TransformerPlan(str(path), dtype="bf16", weights=weights, max_tokens=1 << 17)
    loaded = remote_load_transformer(gpu_pool, plan, name="medium", timeout=600)
    pm = PoolModel(lambda: gpu_pool, lambda: None, "medium", key=loaded["key"])
    g = torch.Generator().manual_seed(3)
    widths = loaded["context_widths"]
    ctx = torch.randn(1, 16, sum(widths), generator=g).to(torch.bfloat16)
    small = torch.randn(1, 128, 2, 4, 4, generator=g).to(torch.bfloat16)
    t = (torch.full((1,), 0.7), torch.full((1,), 0.7))
    before = pm.forward(small, t, ctx)
    big = torch.randn(1, 128, 32, 64, 64, generator=g).to(torch.bfloat16)  # 131,072 tokens
    params = {"model": "medium", "key": loaded["key"], "context_id": uuid.uuid4().hex[:16], "frame_rate": 25.0,
              "av_timestep": "scaled", "patches": "none", "kwargs": []}
    job = gpu_pool.submit("forward", params, {"x.0": big, "t.0": t[0], "t.1": t[1], "context": ctx})
    deadline = time.monotonic() + 120
    while (gpu_pool.status(timeout=10)["current"] or {}).get("id") != job.id:
        assert time.monotonic() < deadline, "the forward never started"
        time.sleep(0.01)
    job.cancel()
    with pytest.raises(JobCancelledError, match=r"cancelled after \d step boundaries"):
        job.wait(timeout=300)
    after = pm.forward(small, t, ctx)
    assert torch.equal(after, before)
    gpu_pool.request("unload", {"names": ["medium"]}, timeout=120)


def test_generate_on_two_gpus_writes_the_video(tmp_path, capsys):
    runtime = short_dir()
    try:
        rc = main(["generate", "--prompt", "A red fox running through fresh snow at dawn", "--gpus", "2",
                   "--frames", "17", "--height", "64", "--width", "96", "--steps", "2", "--seed", "7",
                   "--out", str(tmp_path / "fox.mp4"), "--runtime-dir", str(runtime), "--cache",
                   str(tmp_path / "cache")])
        out, err = capsys.readouterr()
    finally:
        cleanup(runtime)
    assert rc == 0, err
    assert "world size 2 (cuda ranks)" in out, out
    assert (tmp_path / "fox.mp4").stat().st_size > 0
