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
  weights; FP8 compute under Ulysses, CFG-parallel and FSDP2 on 2 ranks equals world size 1;
* compiling: the perturbation view a compiled block gets answers as ltx-core's config (the
  graphs shared across blocks: ``tests/integration/test_compile_blocks.py``).
"""

from __future__ import annotations

import pytest
import torch
from fp8_support import rel, tiny_files
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.denoise.checkpoint import CheckpointError, StateDictLoader, inspect_checkpoint
from ltx_mgpu.denoise.fp8 import (
    E4M3_MAX,
    BlockPerturbations,
    Float8Linear,
    fp8_support_error,
    quantize_rows,
    rounding_noise,
    swap_linears,
)
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import Fp8Config, TransformerPlan

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
    assert rel(w, ref_w) < 0.03
    exact = torch.nn.functional.linear(x, ref_w, bias)
    for cfg in (Fp8Config("fp8", "row"), Fp8Config("fp8", "row", bias_epilogue=False), Fp8Config("fp8", "tensor")):
        layer.config = cfg
        layer.set_weight(ref_w)
        y = layer(x)
        assert y.shape == (5, 7, 320) and 0 < rel(y, exact) < 0.06, cfg


def test_choices_are_validated_once_with_the_choices_named():
    with pytest.raises(ValueError, match="fp8 compute must be one of 'upcast' or 'fp8', got 'int8'"):
        Fp8Config("int8")
    with pytest.raises(ValueError, match="fp8 scaling must be one of 'row' or 'tensor'"):
        Fp8Config("fp8", "block")


def test_fp8_compute_is_refused_on_a_cpu_naming_the_fix(tmp_path):
    msg = fp8_support_error(torch.device("cpu"))
    assert "FP8 tensor cores" in msg and "choose dtype 'bf16'" in msg
    _, fp8_file = tiny_files(tmp_path)
    with pytest.raises(ValueError, match="choose dtype 'bf16'"):
        load_ltx_model(TransformerPlan(fp8_file, dtype="fp8"), "cpu")


def test_fp8_compute_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 3090")
    msg = fp8_support_error(torch.device("cuda", 0))
    assert msg == ("dtype 'fp8' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                   "NVIDIA GeForce RTX 3090 is 8.6: choose dtype 'bf16' (or 'fp16')")


def test_the_loader_keeps_e4m3_weights_as_stored_with_their_scales(tmp_path):
    _, fp8_file = tiny_files(tmp_path)
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
    _, fp8_file = tiny_files(tmp_path)
    sd = load_file(fp8_file)
    key = "transformer_blocks.0.ff.net.0.proj"
    sd[f"{key}.scale_weight"] = torch.ones(3)  # neither one value nor one per row
    bad = tmp_path / "bad.safetensors"
    with safe_open(fp8_file, "pt") as f:
        save_file(sd, str(bad), metadata=f.metadata())
    match = (r"transformer_blocks\.0\.ff\.net\.0\.proj\.scale_weight is F32 \[3\]; a float8_e4m3fn weight scale is "
             r"one number or one per row \(\[\d+\] or \[\d+, 1\]\).*the file is damaged")
    with pytest.raises(CheckpointError, match=match):  # from the header, before any weight is read
        inspect_checkpoint(bad)
    with pytest.raises(CheckpointError, match=match):
        load_ltx_model(TransformerPlan(bad, dtype="fp32"))


# --------------------------------------------------------------------------- real ranks


# --------------------------------------------------------------------------- a pool




def test_a_blocks_perturbation_view_answers_as_ltx_cores_config():
    """``BlockPerturbations`` (what a compiled block gets) gives ltx-core's answers for each block
    and perturbation type: STG configs mixed per sample, and None (nothing perturbed)."""
    mixed = BatchedPerturbationConfig([
        PerturbationConfig([Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1]),
                            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None)]),
        PerturbationConfig(None),
        PerturbationConfig([Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, [0, 2])]),
    ])
    values = torch.ones(3, 5, 4, dtype=torch.bfloat16)
    for config, ref in ((mixed, mixed), (None, BatchedPerturbationConfig.empty(3))):
        for block in range(4):
            view = BlockPerturbations(config, block, 3)
            for t in PerturbationType:
                assert view.all_in_batch(t, -1) == ref.all_in_batch(t, block)
                assert view.any_in_batch(t, -1) == ref.any_in_batch(t, block)
                want = ref.mask_like(t, block, values)
                got = view.mask_like(t, -1, values)
                assert got.dtype == want.dtype and got.shape == want.shape == (3, 1, 1) and torch.equal(got, want)
