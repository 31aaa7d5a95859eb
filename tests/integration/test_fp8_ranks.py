"""FP8 linears on real gloo ranks: an fp8 file sharded over 2 and 4 ranks gathers e4m3 and equals
the replicated load; FP8 compute under sequence parallelism, CFG-parallel and sharding equals
world size 1; a CPU pool refuses dtype fp8 naming the fix and merges ComfyUI's patches into e4m3
shards. The layers in one process: ``tests/unit/test_fp8.py``.
"""

from __future__ import annotations

import pytest
import torch
from fp8_support import REL, rel, tiny_files
from safetensors.torch import load_file
from sp_harness import reference, run_case, run_ranks

from ltx_mgpu.denoise.checkpoint import inspect_checkpoint
from ltx_mgpu.denoise.model import export_transformer_only, load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_fp8_file_gathers_e4m3_and_equals_the_replicated_load(tmp_path, world):
    f32_file, fp8_file = tiny_files(tmp_path)
    shape = dict(frames=3, height=3, width=5, audio_tokens=7)
    cases = [dict(name="fp8_av", **shape, checkpoint=fp8_file, sharded=True),
             dict(name="fp8_cfg_mask", **shape, batch=2, attention_mask=True, checkpoint=fp8_file, sharded=True),
             dict(name="f32_av", **shape, checkpoint=f32_file, sharded=True)]
    reports = run_ranks(world, cases, tmp_path)
    replicated = load_ltx_model(TransformerPlan(fp8_file, dtype="fp32")).transformer  # e4m3 upcast at load
    for case in cases[:2]:
        with torch.no_grad():
            ref_v, ref_a = run_case(replicated, case)
        for r in range(world):
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert rel(got["video"], ref_v) <= REL and rel(got["audio"], ref_a) <= REL, (case["name"], r)
    info = inspect_checkpoint(fp8_file)
    linears = [info.shapes[k] for k in info.e4m3_keys]
    # what the gathers should carry: the float32 file's bytes, each e4m3 weight at 1 byte instead of 4,
    # plus its float32 row scales
    saved = sum(o * i for o, i in linears) * 3 - sum(o for o, _ in linears) * 4
    for report in reports:
        fp8, f32 = report["fp8_av"], report["f32_av"]
        assert fp8["error"] is None and f32["error"] is None
        expected = f32["gathered_bytes"] - saved
        assert abs(fp8["gathered_bytes"] - expected) <= 0.02 * expected, (fp8["gathered_bytes"], expected)
        s = fp8["sharding"]
        assert s["held_after"] <= s["total_bytes"] / world * 1.05 + 4096, s


def test_fp8_compute_under_sequence_parallelism_cfg_parallel_and_sharding_equals_world_size_one(tmp_path):
    """The compiled e4m3 blocks (per-token activation scales, so a token's quantisation does not
    depend on how the tokens are split) with the Ulysses exchanges as one operator of the
    compiled graph (running eagerly inside it), on 2 gloo ranks: Ulysses, CFG-parallel and
    FSDP2-sharded weights equal the compiled fp8 model at world size 1."""
    shape = dict(frames=3, height=3, width=5, audio_tokens=7, batch=2, fp8_compute=True)
    cases = [dict(name="fp8_sharded_ulysses", **shape, layout="ulysses", sharded=True),
             dict(name="fp8_cfg", **shape, layout="cfg_ulysses")]
    reports = run_ranks(2, cases, tmp_path, timeout=600)
    ref_v, ref_a = reference(cases[0])
    for case in cases:
        for r, report in enumerate(reports):
            assert report[case["name"]]["error"] is None, report[case["name"]]["error"]
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert rel(got["video"], ref_v) <= 1e-4 and rel(got["audio"], ref_a) <= 1e-4, \
                (case["name"], r, rel(got["video"], ref_v), rel(got["audio"], ref_a))
    assert reports[0]["fp8_cfg"]["samples"] == [1, 1] and reports[0]["fp8_sharded_ulysses"]["samples"] == [2]


def _pool(base, ranks: int):
    from ltx_mgpu.client.pool_client import PoolClient

    return PoolClient.connect(gpus="cpu", nproc=ranks, runtime_dir=base, lifetime="with-owner", startup_timeout=120)


def test_a_cpu_pool_refuses_dtype_fp8_and_merges_patches_into_e4m3_shards(base, tiny_ltx_23, tmp_path):
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.errors import PoolError
    from ltx_mgpu.client.model import PoolModel

    fp8_file = str(export_transformer_only(tiny_ltx_23, tmp_path / "ltx23_fp8.safetensors", fp8="scaled"))
    pool = _pool(base, 2)
    try:
        with pytest.raises(PoolError, match="FP8 tensor cores.*choose dtype 'bf16'"):
            remote_load_transformer(pool, TransformerPlan(fp8_file, dtype="fp8"), name="f", timeout=180)
        rep = remote_load_transformer(pool, TransformerPlan(fp8_file, dtype="fp32"), name="rep", timeout=180)
        sh = remote_load_transformer(pool, TransformerPlan(fp8_file, dtype="fp32", weights="sharded"),
                                     name="sh", timeout=180)
        sh32 = remote_load_transformer(pool, TransformerPlan(str(tiny_ltx_23), dtype="fp32", weights="sharded"),
                                       name="sh32", timeout=180)
        assert [r["plan"]["linears"] for r in (rep, sh, sh32)] == ["dense", "upcast", "dense"]
        assert [r["plan"]["storage"] for r in (rep, sh, sh32)] == ["e4m3", "e4m3", "dense"]
        # each rank holds its rows of the e4m3 weights at 1 byte (+ a float32 scale per row) instead of 4
        linears = [inspect_checkpoint(fp8_file).shapes[k] for k in inspect_checkpoint(fp8_file).e4m3_keys]
        saved = (sum(o * i for o, i in linears) * 3 - sum(o for o, _ in linears) * 4) / 2
        assert abs((sh32["bytes"] - sh["bytes"]) - saved) <= 0.05 * saved, (sh32["bytes"], sh["bytes"], saved)
        g = torch.Generator().manual_seed(3)
        x = [torch.randn(2, 128, 3, 3, 5, generator=g), torch.randn(2, 8, 7, 16, generator=g)]
        t = (torch.full((2,), 0.6), torch.full((2,), 0.6))
        ctx = torch.randn(2, 1024, sum(sh["context_widths"]), generator=g)
        q = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
        width = rep["context_widths"][0]
        up, down = 0.5 * torch.randn(width, 2, generator=g), torch.randn(2, width, generator=g)

        class Lora:
            name, weights = "lora", (up, down, None, None, None, None)

        patches = ("p1", {q: [(0.5, Lora(), 1.0, None, None)]})
        outs = {}
        for name, res in (("rep", rep), ("sh", sh)):
            pm = PoolModel(lambda: pool, lambda: None, name=name, key=res["key"])
            plain = pm.forward(x, t, ctx, frame_rate=24.0)
            patched = pm.forward(x, t, ctx, frame_rate=24.0, patches=patches)
            pm.sync_patches("none", {})
            outs[name] = (plain, patched, pm.forward(x, t, ctx, frame_rate=24.0))
        for a, b in zip(outs["sh"][0], outs["rep"][0]):
            assert rel(a, b) <= REL  # e4m3 upcast after the gather = upcast at load
        for a, b in zip(outs["sh"][2], outs["sh"][0]):
            assert torch.equal(a, b)  # the patch removed: the file's e4m3 weights again
        # the merged weight is re-quantised per row (the replicated load keeps it in float32)
        assert rel(outs["sh"][1][0], outs["sh"][0][0]) > 1e-4
        assert rel(outs["sh"][1][0], outs["rep"][1][0]) < 0.05
    finally:
        pool.shutdown()
