"""The SP Sampler with sequence parallelism at 2 gloo ranks (separate processes) equals world
size 1, audio-video with CFG, a noise mask and a LoRA, and video only. The sampler's checks in
one process: ``tests/unit/test_sampler.py``.

Run as ``python tests/integration/test_sampler_ranks.py SPEC RANK`` it is one SP rank (see ``_rank_main``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from sampler_support import SIGMAS, av_latent, cond, latent_parts

from ltx_mgpu.denoise.comfyui.sampler import sample
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan

SP_CASES = [
    dict(name="av_odd_cfg_lora_masked", latent=dict(f=3, h=3, w=5, n=7, masked=True), cfg=3.0, lora=True),
    dict(name="video_only_cfg1", latent=dict(f=3, h=3, w=5), video_only=True, cfg=1.0, lora=False),
]


def _write_lora(path: Path) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(8)
    sd = {}
    for m, (o, i) in {"transformer_blocks.0.attn1.to_q": (32, 32),
                      "transformer_blocks.1.video_to_audio_attn.to_k": (16, 32)}.items():
        sd[f"diffusion_model.{m}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"diffusion_model.{m}.lora_B.weight"] = 0.5 * torch.randn(o, 2, generator=g)
    save_file(sd, str(path))


def _run_case(case: dict, ckpt: str, lora: str, velocity=None):
    model = load_ltx_model(TransformerPlan(ckpt, dtype="fp32", loras=[(lora, 1.0)] if case["lora"] else ()))
    latent = av_latent(**case["latent"])
    if case.get("video_only"):
        latent = {"samples": latent["samples"].tensors[0]}
    vel = velocity(model) if velocity else None
    return latent_parts(sample(model, cond(48, 9, 1), cond(48, 5, 2), latent, sigmas=SIGMAS, cfg=case["cfg"], seed=4,
                           velocity_model=vel))


def _rank_main(spec_path: str, rank: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=spec["world"])
    for case in spec["cases"]:
        outs = _run_case(case, spec["ckpt"], spec["lora"], velocity=lambda m: m.velocity_model(None))
        save_file({f"t{i}": t.contiguous() for i, t in enumerate(outs)},
                  str(Path(spec_path).parent / f"r{rank}_{case['name']}.safetensors"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp_run(tiny_ltx_23, tmp_path_factory):
    from sp_harness import free_port

    out = tmp_path_factory.mktemp("sp_sampler")
    lora = out / "lora.safetensors"
    _write_lora(lora)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cases": SP_CASES, "port": free_port(), "world": 2, "ckpt": str(tiny_ltx_23),
                                "lora": str(lora)}))
    from rank_support import run_rank_processes

    run_rank_processes(__file__, str(spec), 2, timeout=120)
    return out, str(tiny_ltx_23), str(lora)


@pytest.mark.parametrize("case", SP_CASES, ids=[c["name"] for c in SP_CASES])
def test_sequence_parallel_sampler_equals_world_size_one(sp_run, case):
    from safetensors.torch import load_file

    out, ckpt, lora = sp_run
    ref = _run_case(case, ckpt, lora)
    if case["lora"]:  # the LoRA matters, so parity with it applied is not vacuous
        plain = _run_case(dict(case, lora=False), ckpt, lora)
        assert not torch.allclose(plain[0], ref[0])
    for rank in range(2):
        got = load_file(str(out / f"r{rank}_{case['name']}.safetensors"))
        assert len(got) == len(ref)
        for i, r in enumerate(ref):
            assert (got[f"t{i}"] - r).abs().max().item() <= 1e-5


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
    # Skip interpreter finalisation: gloo's background threads can abort a rank in static
    # destructors after the group is destroyed (seen in tests/integration/test_agree.py under load); the
    # results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
