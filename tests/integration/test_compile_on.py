"""The Model Loader's ``compile: on`` in one process (fp32 on CPU, Inductor): the blocks of a
dense checkpoint run compiled (``TransformerPlan.compiled``), a call with one timestep per sample
(``[B, 1]``) equals the eager one (per-token ``[B, T]`` calls on compiled blocks: the fp8
tests, which always ran them), and Stop
(``LTXDenoiser.stoppable``) cuts a call between compiled blocks, as with eager ones, leaving the
compiled forwards in place. On 2 pool ranks (LoRA patches, skip-layer guidance, reloads):
``tests/integration/test_model_path.py``."""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.denoise.comfyui.forward import comfy_forward, processed_context
from ltx_mgpu.denoise.comfyui.skip_blocks import skipped_blocks
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan

TOL = 1e-5


def _x():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(1, 128, 3, 3, 5, generator=g), torch.randn(1, 8, 7, 16, generator=g)]


def _diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def models(tiny_ltx_23, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LTX_MGPU_COMPILE_CACHE_DIR", str(tmp_path_factory.mktemp("compile")))
        compiled = load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", compile="on"))
        yield compiled, load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))


def test_compiled_blocks_take_one_timestep_per_sample_and_stop_between_blocks(models):
    compiled, eager = models
    assert compiled.plan.compiled and not eager.plan.compiled
    assert all("forward" in b.__dict__ for b in compiled.transformer.transformer_blocks)
    ctx = processed_context(eager, torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(1)), True)
    x = _x()
    per_sample = (torch.full((1,), 0.7), torch.full((1,), 0.4))
    with torch.no_grad():
        want = comfy_forward(eager, eager.transformer, x, per_sample, ctx)
        got = comfy_forward(compiled, compiled.velocity_model(), x, per_sample, ctx)
        assert _diff(got, want) <= TOL
        with skipped_blocks(eager.transformer, [1]):
            cut_want = comfy_forward(eager, eager.transformer, x, per_sample, ctx)
    own = [b.__dict__["forward"] for b in compiled.transformer.transformer_blocks]
    asked = []
    with torch.no_grad(), compiled.stoppable(lambda: asked.append(1) or len(asked) == 2) as stopped:
        cut = comfy_forward(compiled, compiled.velocity_model(), x, per_sample, ctx)
    assert stopped() and len(asked) == 2
    assert _diff(cut, cut_want) <= TOL  # block 0 ran compiled, block 1 passed its inputs through
    assert [b.__dict__["forward"] for b in compiled.transformer.transformer_blocks] == own
    with torch.no_grad():
        assert _diff(comfy_forward(compiled, compiled.velocity_model(), x, per_sample, ctx), got) == 0.0
