"""Packed transformer files on real gloo ranks: GGUF Q4_K and Q8_0 files and ComfyUI nvfp4 and
int8 ConvRot files, replicated under Ulysses and FSDP2-sharded over 2 and 4 ranks, equal the
float32 file of the same values at world size 1 (fp32, 1e-5); the shards hold the file's GGML
blocks or packed rows and the all-gathers carry them (counted, as for fp8); a CPU pool loads a
GGUF and an nvfp4 file, reports them packed and merges ComfyUI's patches into them.
The layers in one process: ``tests/unit/test_gguf_transformer.py``,
``tests/unit/test_comfy_quant_transformer.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gguf_support import AV_ODD_CASE, REL, packed_pair, rel, wide_file
from safetensors.torch import load_file
from sp_harness import run_case, run_ranks

from ltx_mgpu.denoise.checkpoint import inspect_checkpoint, packed_weight
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike
from ltx_mgpu.quantized.packed import packed_shape

#: The files of the rank tests: two GGML types and two ComfyUI formats.
KINDS = ("Q4_K", "Q8_0", "nvfp4", "int8_convrot")


def _packed_saving(path) -> int:
    """float32 bytes minus packed bytes of the packed weights of file ``path``."""
    info = inspect_checkpoint(path)
    return sum(math.prod(info.shapes[k]) * 4 - math.prod(packed_shape(t, info.shapes[k]))
               for k in info.shapes if packed_weight(k, t := info.stored_type(k)))


@pytest.mark.parametrize("world", [2, 4])
def test_a_packed_file_replicated_and_sharded_equals_its_dequantized_weights(tmp_path, world):
    src = wide_file(tmp_path)
    files = {q: packed_pair(src, tmp_path, q) for q in KINDS}
    cases = []
    for q, (gguf_path, reference) in files.items():
        cases += [dict(AV_ODD_CASE, name=f"{q}_replicated", checkpoint=str(gguf_path)),
                  dict(AV_ODD_CASE, name=f"{q}_sharded", checkpoint=str(gguf_path), sharded=True),
                  dict(AV_ODD_CASE, name=f"{q}_dense_sharded", checkpoint=str(reference), sharded=True)]
    reports = run_ranks(world, cases, tmp_path, timeout=600)
    for q, (gguf_path, reference) in files.items():
        with torch.no_grad():
            ref_v, ref_a = run_case(load_ltx_model(TransformerPlan(reference, dtype="fp32")).transformer, AV_ODD_CASE)
        for r, report in enumerate(reports):
            for how in ("replicated", "sharded"):
                name = f"{q}_{how}"
                assert report[name]["error"] is None, report[name]["error"]
                got = load_file(str(tmp_path / f"rank{r}_{name}.safetensors"))
                assert rel(got["video"], ref_v) <= REL and rel(got["audio"], ref_a) <= REL, (name, r)
            packed, dense = report[f"{q}_sharded"], report[f"{q}_dense_sharded"]
            # the gathers move the packed bytes: the float32 file's traffic less what packing saves
            expected = dense["gathered_bytes"] - _packed_saving(gguf_path)
            assert abs(packed["gathered_bytes"] - expected) <= 0.02 * expected, (q, packed["gathered_bytes"], expected)
            s = packed["sharding"]
            assert s["held_after"] <= s["total_bytes"] / world * 1.05 + 4096, s


@pytest.mark.parametrize("kind, storage", [("Q4_K", "ggml"), ("nvfp4", "comfy_quant")])
def test_a_cpu_pool_loads_a_packed_file_and_merges_patches_into_it(base, tmp_path, kind, storage):
    from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient

    gguf_path, reference = packed_pair(wide_file(tmp_path), tmp_path, kind)
    pool = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="with-owner", startup_timeout=120)
    try:
        loads = {name: remote_load_transformer(pool, TransformerPlan(str(path), dtype="fp32", weights=weights),
                                               name=name, timeout=180)
                 for name, path, weights in (("rep", gguf_path, "replicated"), ("sh", gguf_path, "sharded"),
                                             ("dense", reference, "replicated"))}
        assert [loads[n]["plan"]["linears"] for n in ("rep", "sh", "dense")] == ["packed", "packed", "dense"]
        assert [loads[n]["plan"]["storage"] for n in ("rep", "sh", "dense")] == [storage, storage, "dense"]
        saving = _packed_saving(gguf_path)
        assert abs((loads["dense"]["bytes"] - loads["rep"]["bytes"]) - saving) <= 0.02 * saving
        g = torch.Generator().manual_seed(3)
        x = [torch.randn(2, 128, 3, 3, 5, generator=g), torch.randn(2, 8, 7, 16, generator=g)]
        t = (torch.full((2,), 0.6), torch.full((2,), 0.6))
        ctx = torch.randn(2, 64, 512, generator=g)
        q = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
        up, down = torch.randn(256, 2, generator=g), torch.randn(2, 256, generator=g)

        class Lora:
            name, weights = "lora", (up, down, None, None, None, None)

        patches = ("p1", {q: [(0.5, Lora(), 1.0, None, None)]})
        outs = {}
        for name in loads:
            pm = PoolModel(lambda: pool, lambda: None, name=name, key=loads[name]["key"])
            plain = pm.forward(x, t, ctx, frame_rate=24.0)
            patched = pm.forward(x, t, ctx, frame_rate=24.0, patches=patches)
            pm.sync_patches("none", {})
            outs[name] = (plain, patched, pm.forward(x, t, ctx, frame_rate=24.0))
        for name in ("rep", "sh"):
            for i in range(2):  # unpatched and patched: the dense file's result
                for a, b in zip(outs[name][i], outs["dense"][i]):
                    assert rel(a, b) <= REL, (name, i)
            for a, b in zip(outs[name][2], outs[name][0]):
                assert torch.equal(a, b)  # the patch removed: the file's blocks again
        assert rel(outs["rep"][1][0], outs["rep"][0][0]) > 100 * REL  # the patch mattered
        # the SP Sampler on the same models: the dense file's latent
        latent = {"samples": NestedTensorLike([x[0][:1], x[1][:1]]), "type": "audio"}
        pos, neg = [[ctx[:1], {"pooled_output": None}]], [[ctx[1:], {"pooled_output": None}]]
        sampled = {name: remote_sample(pool, SampleRequest(pos, neg, latent, model=name, cfg=3.0, seed=5,
                                                           sigmas=[1.0, 0.6, 0.0]), timeout=180)
                   for name in loads}
        for name in ("rep", "sh"):
            for a, b in zip(sampled[name]["samples"].tensors, sampled["dense"]["samples"].tensors, strict=True):
                assert rel(a, b) <= REL, name
    finally:
        pool.shutdown()
