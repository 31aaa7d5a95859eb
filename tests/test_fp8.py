"""FP8 linear layers (``ltx_mgpu.denoise.fp8``): fp8 storage of a sharded fp8 checkpoint, and the
refusals of FP8 compute off FP8 GPUs. FP8 compute's numerics and speed are the GPU's
(``tests/test_cuda.py``, ``benchmarks/bench_fp8.py``); its layer is checked here on the CPU,
whose torch also runs ``torch._scaled_mm``.

* the layer: per-row e4m3 quantisation round trips, stochastic rounding keeps a small LoRA
  delta on average where rounding to nearest drops it, ``compute="upcast"`` is exactly the
  loader's upcast, ``compute="fp8"`` is within e4m3's rounding of the float GEMM;
* loading: the file's e4m3 weights are kept as stored (same bytes, same scales); a scale that
  fits neither per-tensor nor per-row scaling is refused;
* real gloo ranks: an fp8 file sharded over 2 and 4 ranks (8 blocks, 45 video tokens, a CFG
  batch with a mask) equals the replicated load that upcasts at load (<= 1e-5, fp32), the
  all-gathers carry e4m3 (the bytes they deliver, counted, are the float32 file's with every
  e4m3 weight at 1 byte plus its row scales), and a rank holds ~1/N of the weights;
* a pool: ``dtype: fp8`` on CPU ranks is refused, naming the fix, before anything loads; a
  sharded fp8 file on the MODEL path equals the replicated load, ComfyUI LoRA patches merge
  into the e4m3 shards (stochastically rounded per row) and removing them restores the file's
  weights; FP8 compute under Ulysses, CFG-parallel and FSDP2 on 2 ranks equals world size 1.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sp_harness import build_tiny_model, reference, run_case, run_ranks, tiny_config

from ltx_mgpu.denoise.checkpoint import CheckpointError, StateDictLoader, inspect_checkpoint
from ltx_mgpu.denoise.fp8 import (
    E4M3_MAX,
    Float8Linear,
    fp8_support_error,
    quantize_rows,
    rounding_noise,
    swap_linears,
)
from ltx_mgpu.denoise.model import export_transformer_only, load_ltx_model
from ltx_mgpu.denoise.plan import Fp8Config, TransformerPlan

REL = 1e-5
DEEP = {"num_layers": 8}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _tiny_files(tmp_path) -> tuple[str, str]:
    """(float32 transformer-only file, the same exported as ComfyUI scaled fp8) of the 8-block
    tiny model of ``sp_harness``."""
    model = build_tiny_model(**DEEP)
    src = tmp_path / "tiny_f32.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src),
              metadata={"config": json.dumps(tiny_config(**DEEP))})
    dst = export_transformer_only(src, tmp_path / "tiny_fp8.safetensors", prefix="", fp8="scaled")
    return str(src), str(dst)


# --------------------------------------------------------------------------- the layer


def test_per_row_quantisation_round_trips_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different ranges
    q, s = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64,) and s.dtype == torch.float32
    assert torch.allclose(q.float().abs().amax(1), torch.full((64,), E4M3_MAX))  # each row uses the full range
    back = q.float() * s[:, None]
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s[:, None] * 2 ** -9).all()  # 3 mantissa bits; subnormals
    q2, s2 = quantize_rows(back, s)  # values on the grid with their scale: exact
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def test_stochastic_rounding_keeps_a_small_lora_delta_that_rounding_to_nearest_drops():
    g = torch.Generator().manual_seed(2)
    q0, s = quantize_rows(torch.randn(256, 512, generator=g))
    base = q0.float() * s[:, None]  # a weight as an fp8 file holds it
    delta = 0.003 * base  # a LoRA's change: well under half an e4m3 step
    nearest, _ = quantize_rows(base + delta, s)
    noise = rounding_noise("transformer_blocks.0.attn1.to_q.weight", base.shape, "cpu")
    stochastic, _ = quantize_rows(base + delta, s, noise)
    kept = [float(((q.float() * s[:, None] - base) * delta).sum() / (delta * delta).sum())
            for q in (nearest, stochastic)]
    assert kept[0] == 0.0 and 0.9 < kept[1] < 1.1, kept  # the share of the delta that survives
    # the noise is the key's alone: a shard draws its rows of the same values on every rank
    again = rounding_noise("transformer_blocks.0.attn1.to_q.weight", base.shape, "cpu")
    assert torch.equal(noise[64:128], again[64:128])
    # each value becomes one of its two e4m3 neighbours, with the probability that keeps the mean
    x = torch.full((1, 20000), 1.3)
    q, _ = quantize_rows(x, torch.ones(1), torch.rand(1, 20000, generator=g))
    assert set(q.float().unique().tolist()) == {1.25, 1.375} and abs(q.float().mean().item() - 1.3) < 2e-3


def test_a_layer_returns_an_empty_output_for_no_tokens():
    layer = Float8Linear(256, 64, True, torch.float32, Fp8Config("fp8"))
    layer.set_weight(torch.randn(64, 256))
    torch.nn.init.zeros_(layer.bias)
    assert layer(torch.randn(2, 0, 256)).shape == (2, 0, 64)


def test_upcast_is_the_loaders_cast_and_fp8_compute_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(256, 320)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(320, 256, generator=g) / 16)
    model = torch.nn.Sequential(lin)
    ref_w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    swap_linears(model, Fp8Config("upcast"), ["0"])
    layer = model[0]
    assert isinstance(layer, Float8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(5, 7, 256, generator=g)
    # exactly what the loader computes for a replicated model: (q.float() * s).to(dtype), then F.linear
    w = (layer.weight.float() * layer.weight_scale[:, None]).to(torch.float32)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, bias))
    assert _rel(w, ref_w) < 0.03
    exact = torch.nn.functional.linear(x, ref_w, bias)
    for cfg in (Fp8Config("fp8", "row"), Fp8Config("fp8", "row", bias_epilogue=False), Fp8Config("fp8", "tensor")):
        layer.config = cfg
        layer.set_weight(ref_w)
        y = layer(x)
        assert y.shape == (5, 7, 320) and 0 < _rel(y, exact) < 0.06, cfg


def test_choices_are_validated_once_with_the_choices_named():
    with pytest.raises(ValueError, match="fp8 compute must be one of 'upcast' or 'fp8', got 'int8'"):
        Fp8Config("int8")
    with pytest.raises(ValueError, match="fp8 scaling must be one of 'row' or 'tensor'"):
        Fp8Config("fp8", "block")


def test_fp8_compute_is_refused_on_a_cpu_naming_the_fix(tmp_path):
    msg = fp8_support_error(torch.device("cpu"))
    assert "FP8 tensor cores" in msg and "choose dtype 'bf16'" in msg
    _, fp8_file = _tiny_files(tmp_path)
    with pytest.raises(ValueError, match="choose dtype 'bf16'"):
        load_ltx_model(TransformerPlan(fp8_file, dtype="fp8"), "cpu")


def test_fp8_compute_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 3090")
    msg = fp8_support_error(torch.device("cuda", 0))
    assert msg == ("dtype 'fp8' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                   "NVIDIA GeForce RTX 3090 is 8.6: choose dtype 'bf16' (or 'fp16')")


def test_the_loader_keeps_e4m3_weights_as_stored_with_their_scales(tmp_path):
    _, fp8_file = _tiny_files(tmp_path)
    info = inspect_checkpoint(fp8_file)
    key = "transformer_blocks.3.ff.net.0.proj.weight"
    assert key in info.e4m3_keys and "transformer_blocks.3.scale_shift_table" not in info.e4m3_keys
    loader = StateDictLoader(info, torch.float32, {}, keep_e4m3={key}, rows={key: slice(8, 40)})
    sd = loader.load(fp8_file).sd
    with safe_open(fp8_file, "pt") as f:
        stored, scale = f.get_tensor(key), f.get_tensor(key.replace(".weight", ".scale_weight"))
    assert sd[key].dtype == torch.float8_e4m3fn
    assert torch.equal(sd[key].view(torch.uint8), stored[8:40].view(torch.uint8))
    assert torch.equal(loader.scales[key].reshape(()), scale.float().reshape(()))
    other = "transformer_blocks.3.attn1.to_q.weight"  # not asked for: upcast as before
    assert sd[other].dtype == torch.float32


def test_an_fp8_scale_of_the_wrong_size_is_refused_naming_the_fix(tmp_path):
    _, fp8_file = _tiny_files(tmp_path)
    sd = load_file(fp8_file)
    key = "transformer_blocks.0.ff.net.0.proj"
    sd[f"{key}.scale_weight"] = torch.ones(3)  # neither one value nor one per row
    bad = tmp_path / "bad.safetensors"
    with safe_open(fp8_file, "pt") as f:
        save_file(sd, str(bad), metadata=f.metadata())
    with pytest.raises(CheckpointError, match=r"\(3,\) fp8 scale fits neither per-tensor nor per-row scaling; use"):
        load_ltx_model(TransformerPlan(bad, dtype="fp32"))


# --------------------------------------------------------------------------- real ranks


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_fp8_file_gathers_e4m3_and_equals_the_replicated_load(tmp_path, world):
    f32_file, fp8_file = _tiny_files(tmp_path)
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
            assert _rel(got["video"], ref_v) <= REL and _rel(got["audio"], ref_a) <= REL, (case["name"], r)
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


@pytest.mark.slow
def test_fp8_compute_under_sequence_parallelism_cfg_parallel_and_sharding_equals_world_size_one(tmp_path):
    """The compiled e4m3 blocks (per-token activation scales, so a token's quantisation does not
    depend on how the tokens are split) with the Ulysses exchanges running eagerly between the
    compiled regions, on 2 gloo ranks: Ulysses, CFG-parallel and FSDP2-sharded weights equal the
    compiled fp8 model at world size 1."""
    shape = dict(frames=3, height=3, width=5, audio_tokens=7, batch=2, fp8_compute=True)
    cases = [dict(name="fp8_sharded_ulysses", **shape, layout="ulysses", sharded=True),
             dict(name="fp8_cfg", **shape, layout="cfg_ulysses")]
    reports = run_ranks(2, cases, tmp_path, timeout=600)
    ref_v, ref_a = reference(cases[0])
    for case in cases:
        for r, report in enumerate(reports):
            assert report[case["name"]]["error"] is None, report[case["name"]]["error"]
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert _rel(got["video"], ref_v) <= 1e-4 and _rel(got["audio"], ref_a) <= 1e-4, \
                (case["name"], r, _rel(got["video"], ref_v), _rel(got["audio"], ref_a))
    assert reports[0]["fp8_cfg"]["cfg_parallel"] and not reports[0]["fp8_sharded_ulysses"]["cfg_parallel"]


# --------------------------------------------------------------------------- a pool


def _pool(base, ranks: int):
    from ltx_mgpu.client.pool_client import PoolClient

    return PoolClient.connect(gpus="cpu", nproc=ranks, runtime_dir=base, lifetime="with-owner", startup_timeout=120)


@pytest.mark.slow
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
            assert _rel(a, b) <= REL  # e4m3 upcast after the gather = upcast at load
        for a, b in zip(outs["sh"][2], outs["sh"][0]):
            assert torch.equal(a, b)  # the patch removed: the file's e4m3 weights again
        # the merged weight is re-quantised per row (the replicated load keeps it in float32)
        assert _rel(outs["sh"][1][0], outs["sh"][0][0]) > 1e-4
        assert _rel(outs["sh"][1][0], outs["rep"][1][0]) < 0.05
    finally:
        pool.shutdown()
