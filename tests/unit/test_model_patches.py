"""ComfyUI's model patches on the pool MODEL, the parts that need no ComfyUI (``nodes._patches``,
``ltx_mgpu.denoise.comfyui.skip_blocks``, the scale-only weight patch); ComfyUI's own nodes on
both models are ``tests/comfyui/test_comfyui_patch_nodes.py``.

* a ``dit`` double-block replacement that returns its input is a block skip, one that calls the
  original block changes nothing, one that computes is refused naming the node that made it (read
  from the function's qualified name through ``nodes.NODE_CLASS_MAPPINGS``); indices past the
  model's blocks skip nothing (as in ComfyUI's model);
* what ComfyUI's LTX-2 model does not read (attention patches, other replacements) is left and
  logged once per node; attention overrides and branch switches are refused;
* the bypass LoRA hooks ComfyUI injects become LoRA patches with the hook's multiplier;
* a skipped block passes its inputs through (the model equals the model without that block),
  and gets its own (even compiled) ``forward`` back;
* ``(None,)`` at strength 0 (the attention multipliers') scales the weight, and only at strength 0.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.model.transformer import Modality
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape
from nodes_support import PACK

from ltx_mgpu.client.model import SCALE, PatchFormatError, wire_patches
from ltx_mgpu.denoise.comfyui.conditioning import text_contexts
from ltx_mgpu.denoise.comfyui.skip_blocks import SkipBlocksError, skipped_blocks
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.patches import PatchError, WeightPatch, merge
from ltx_mgpu.denoise.plan import TransformerPlan

patches = sys.modules[f"{PACK}.nodes._patches"]
KEY = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"


class SkipLayerGuidanceDiT:
    """Stands in for ComfyUI's node class: its patch functions are closures of ``execute``."""

    @classmethod
    def execute(cls):
        def skip(args, extra_args):  # noqa: ARG001 - ComfyUI's replacement signature
            return args

        def keep(args, extra_args):
            return extra_args["original_block"](args)

        def compute(args, extra_args):  # noqa: ARG001
            return {"img": args["img"] * 2}

        def attention(q, k, v, extra_options):  # noqa: ARG001
            return v

        return skip, keep, compute, attention


@pytest.fixture
def comfy_nodes(monkeypatch):
    """``nodes.NODE_CLASS_MAPPINGS`` as ComfyUI's, with the stand-in node registered."""
    fake = types.ModuleType("nodes")
    fake.NODE_CLASS_MAPPINGS = {"SkipLayerGuidanceDiT": SkipLayerGuidanceDiT}
    monkeypatch.setitem(sys.modules, "nodes", fake)
    monkeypatch.setattr(patches, "_said", set())
    return SkipLayerGuidanceDiT.execute()


def _dit(**blocks) -> dict:
    return {"patches_replace": {"dit": {("double_block", int(i[1:])): f for i, f in blocks.items()}}}


def test_a_replacement_that_returns_its_input_skips_the_block(comfy_nodes):
    skip, keep, _, _ = comfy_nodes
    assert patches.call_plan(_dit(b1=skip, b0=skip), blocks=2) == (0, 1)
    assert patches.call_plan(_dit(b1=keep), blocks=2) == ()
    assert patches.call_plan(_dit(b7=skip, b8=skip), blocks=2) == ()  # no such blocks: ComfyUI's model skips none
    assert patches.call_plan(None, blocks=2) == ()


def test_a_replacement_that_computes_is_refused_naming_its_node(comfy_nodes):
    _, _, compute, _ = comfy_nodes
    with pytest.raises(patches.ModelPatchRefused, match=r"^SkipLayerGuidanceDiT on the multi-GPU LTX-2 MODEL: its "
                                                        r"replacement of transformer block \('double_block', 1\)"):
        patches.call_plan(_dit(b1=compute), blocks=2)


def test_what_comfyuis_ltx_model_does_not_read_is_left_and_logged_once(comfy_nodes, caplog):
    skip, _, _, attention = comfy_nodes
    options = {"patches": {"attn1_output_patch": [attention]},
               "patches_replace": {"attn1": {("middle", 0, None): attention}, "dit": {("single_block", 1): skip}}}
    with caplog.at_level(logging.INFO, logger="ltx_mgpu"):
        assert patches.call_plan(options, blocks=2) == ()
        assert patches.call_plan(options, blocks=2) == ()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all("has no effect on LTX-2" in m for m in said), said
    assert said[0].startswith("ltx_mgpu: SkipLayerGuidanceDiT's attn1_output_patch")


def test_attention_overrides_and_branch_switches_are_refused(comfy_nodes):
    _, _, _, attention = comfy_nodes
    with pytest.raises(patches.ModelPatchRefused, match="^SkipLayerGuidanceDiT on .*optimized_attention_override"):
        patches.call_plan({"optimized_attention_override": attention}, blocks=2)
    with pytest.raises(patches.ModelPatchRefused, match=r"switching off LTX-2's \['a2v_cross_attn'\] branches"):
        patches.call_plan({"a2v_cross_attn": False, "run_vx": True}, blocks=2)


def test_sampling_with_hooks_wrappers_injections_or_another_dtype_is_refused(comfy_nodes, caplog):
    skip, _, _, _ = comfy_nodes
    patcher = types.SimpleNamespace(weight_wrapper_patches={}, injections={}, object_patches={})
    f32 = torch.float32
    patches.check_sampling({"transformer_options": {}}, patcher, f32, 2)
    with caplog.at_level(logging.INFO, logger="ltx_mgpu"):
        patches.check_sampling({"torch_compile_kwargs": {"backend": "inductor"}}, patcher, f32, 2)
    assert "TorchCompileModel compiles nothing" in caplog.text and "compiles its own blocks" in caplog.text
    with pytest.raises(patches.ModelPatchRefused, match="^a conditioning hook node .*LoraLoaderModelOnly"):
        patches.check_sampling({"registered_hooks": [object()]}, patcher, f32, 2)
    wrapped = types.SimpleNamespace(**{**vars(patcher), "weight_wrapper_patches": {"x.weight": [skip]}})
    with pytest.raises(patches.ModelPatchRefused, match=r"^SkipLayerGuidanceDiT on .*weight wrappers \(x.weight\)"):
        patches.check_sampling({}, wrapped, f32, 2)
    injected = types.SimpleNamespace(**{**vars(patcher), "injections": {
        "other": [types.SimpleNamespace(inject=skip)], patches.BYPASS_INJECTIONS: []}})
    with pytest.raises(patches.ModelPatchRefused, match=r"module injections \('other'\)"):
        patches.check_sampling({}, injected, f32, 2)
    cast = types.SimpleNamespace(**{**vars(patcher), "object_patches": {"manual_cast_dtype": torch.bfloat16}})
    with pytest.raises(patches.ModelPatchRefused, match=r"^ModelComputeDtype on .*\(float32\), not bfloat16"):
        patches.check_sampling({}, cast, f32, 2)


def test_a_patch_outside_a_node_class_is_named_by_its_files_nodes_or_its_module(comfy_nodes):
    def wrapper(executor, *args):
        return executor(*args)

    assert patches.patch_node(comfy_nodes[0]) == "SkipLayerGuidanceDiT"
    assert patches.patch_node(wrapper) == "SkipLayerGuidanceDiT"  # the one node of its file
    wrapper.__module__ = "elsewhere"
    assert patches.patch_node(wrapper) == f"{wrapper.__qualname__} of elsewhere"


def test_injected_bypass_hooks_become_lora_patches():
    class BypassForwardHook:  # ComfyUI's comfy.weight_adapter.bypass class, as far as it is read
        def __init__(self, module, adapter, multiplier):
            self.module, self.adapter, self.multiplier = module, adapter, multiplier

        def _bypass_forward(self, x):
            return x

    reference = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    adapter = object()
    hook = BypassForwardHook(reference[1], adapter, 0.7)
    reference[1].forward = hook._bypass_forward
    assert patches.bypass_patches(reference) == {"diffusion_model.1.weight": [(0.7, adapter, 1.0, None, None)]}
    del reference[1].__dict__["forward"]
    assert patches.bypass_patches(reference) == {}


# --------------------------------------------------------------------------- the pool's side


@pytest.fixture(scope="module")
def model(tiny_ltx_23):
    return load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))


def _call(model):
    g = torch.Generator().manual_seed(3)
    vctx, actx = text_contexts(model, torch.randn(1, 9, 48, generator=g), True)
    vshape, ashape = VideoLatentShape(1, 128, 2, 3, 4), AudioLatentShape(1, 8, 5, 16)
    vpos = VideoLatentTools(VideoLatentPatchifier(1), vshape, fps=25.0).create_initial_state("cpu", torch.float32)
    apos = AudioLatentTools(AudioPatchifier(1), ashape).create_initial_state("cpu", torch.float32)
    sigma = torch.tensor([0.6])
    video = Modality(torch.randn(1, 24, 128, generator=g), sigma, sigma.expand(1, 24), vpos.positions, vctx)
    audio = Modality(torch.randn(1, 5, 128, generator=g), sigma, sigma.expand(1, 5), apos.positions, actx)
    with torch.no_grad():
        return model.transformer(video, audio, None)


def test_a_skipped_block_passes_its_inputs_through(model):
    blocks = model.transformer.transformer_blocks
    whole = _call(model)
    with skipped_blocks(model.transformer, [1]):
        skipped = _call(model)
    model.transformer.transformer_blocks = torch.nn.ModuleList([blocks[0]])  # the model without block 1
    try:
        without = _call(model)
    finally:
        model.transformer.transformer_blocks = blocks
    assert all(torch.equal(a, b) for a, b in zip(skipped, without, strict=True))
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(skipped, whole, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_call(model), whole, strict=True))  # its forward is back


def test_a_skipped_block_gets_its_own_forward_back_and_bad_indices_are_refused(model):
    block = model.transformer.transformer_blocks[0]
    own = block.forward
    block.forward = compiled = lambda video, audio, perturbations=None: (video, audio)  # as compile_blocks sets
    try:
        with skipped_blocks(model.transformer, [0]):
            assert block.forward is not compiled
        assert block.forward is compiled
    finally:
        del block.__dict__["forward"]
    assert block.forward == own
    with pytest.raises(SkipBlocksError, match=r"blocks \[2\] to skip are not among this model's 2"), \
            skipped_blocks(model.transformer, [0, 2]):
        pass
    assert "forward" not in block.__dict__


def test_a_diff_patch_without_a_tensor_scales_the_weight_at_strength_0():
    weight = torch.randn(4, 4)
    assert torch.equal(merge(weight, [WeightPatch("scale", 0.0, 1.3)]), (weight * 1.3))
    with pytest.raises(PatchError, match="needs strength 0"):
        WeightPatch("scale", 1.0, 1.3).check(KEY, (4, 4))
    wire = wire_patches({KEY: [(0.0, (None,), 1.3, None, None)]}, lambda obj: "id")
    assert wire.entries == [{"key": KEY, "patches": [{"adapter": SCALE, "strength": 0.0, "strength_model": 1.3}]}]
    assert wire.adapters == {SCALE: ({"id": SCALE, "kind": "scale", "alpha": None}, {})}
    with pytest.raises(PatchFormatError, match="without a tensor at strength 1.0"):
        wire_patches({KEY: [(1.0, (None,), 1.3, None, None)]}, lambda obj: "id")
