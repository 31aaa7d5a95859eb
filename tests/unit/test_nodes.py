"""The ComfyUI nodes without ComfyUI (the bridge's fallbacks): their contract, how the pack loads,
and the bridge with ComfyUI present; no pool runs here (test_nodes_pool.py runs one).

* Contract: every node's INPUT_TYPES / RETURN_TYPES is well formed, ids carry the LTXMGPU
  prefix, every input has a tooltip, defaults lie within their ranges and choices.
* Loading: the pack imports the way ComfyUI imports it, and on a platform where the pool cannot
  run (no fcntl, not Linux) the nodes still load and say why on use.
* The bridge with ComfyUI present: ComfyUI's own interrupt, ProgressBar(node_id=...),
  NestedTensor and unload functions are the ones used (ComfyUI stood in by small modules).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from nodes_support import NODES, PACK_MODULE, av_latent, bridge, denoise_nodes, run, runtime

# --------------------------------------------------------------------------- contract and loading


def test_every_node_declares_a_valid_contract():
    """Each node's schema (ComfyUI's typed V3 schema; here its stand-in, ``nodes._schema``)."""
    assert set(NODES) == {"LTXMGPU_Pool", "LTXMGPU_PoolStatus", "LTXMGPU_Free", "LTXMGPU_GemmaLoader",
                          "LTXMGPU_PromptEncode", "LTXMGPU_PromptBatchEncode", "LTXMGPU_ModelLoader",
                          "LTXMGPU_SPSampler"}
    for nid, cls in NODES.items():
        schema = cls.define_schema()
        assert schema.node_id == nid and nid.startswith("LTXMGPU_")
        assert schema.display_name.startswith("LTX-2 Multi-GPU ") and schema.category == "LTX-2 Multi-GPU"
        assert schema.description and schema.outputs
        for ids in ([i.id for i in schema.inputs], [o.id for o in schema.outputs]):
            assert len(set(ids)) == len(ids), f"{nid}: ids must be unique"  # as ComfyUI's Schema.validate
        for out in schema.outputs:
            assert out.id and out.tooltip, f"{nid}.{out.id} has no tooltip"
        seen_optional = False
        for i in schema.inputs:
            assert i.tooltip, f"{nid}.{i.id} has no tooltip"
            assert i.optional or not seen_optional, f"{nid}.{i.id}: a required input after an optional one"
            seen_optional |= i.optional
            kind, default = i.io_type, getattr(i, "default", None)
            if kind == "COMBO":
                assert default is None or default in i.options, f"{nid}.{i.id}"
            elif kind in ("INT", "FLOAT"):
                assert i.min <= default <= i.max, f"{nid}.{i.id}"
            elif kind == "BOOLEAN":
                assert isinstance(default, bool)
            elif kind == "STRING":
                assert isinstance(default, str)
            else:
                assert kind.isupper(), f"{nid}: {kind}"
        assert [h.value for h in schema.hidden] in ([], ["UNIQUE_ID"])
    # the nodes the pool reports progress for take the hidden id
    for nid in ("LTXMGPU_PromptEncode", "LTXMGPU_PromptBatchEncode", "LTXMGPU_ModelLoader", "LTXMGPU_SPSampler"):
        assert [h.value for h in NODES[nid].define_schema().hidden] == ["UNIQUE_ID"]


def test_the_pack_is_a_comfyui_extension_listing_every_node():
    import asyncio

    extension = asyncio.run(PACK_MODULE.comfy_entrypoint())
    assert asyncio.run(extension.get_node_list()) == list(NODES.values())


def test_sampler_names_match_the_pool():
    from ltx_mgpu.choices import SAMPLERS

    assert tuple(denoise_nodes.SAMPLERS) == tuple(SAMPLERS)


def test_no_torch_distributed_is_a_clear_error(monkeypatch):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no torch.distributed, which the pool needs"):
        run("LTXMGPU_Pool", "cpu", 1, "with-owner", True)


def test_bad_pool_settings_name_the_fix():
    with pytest.raises(ValueError, match="gpus must be 'all', 'cpu' or a list like '0,1'"):
        run("LTXMGPU_Pool", "first two", 1, "with-owner", True)
    with pytest.raises(ValueError, match="lifetime must be one of"):
        run("LTXMGPU_Pool", "cpu", 1, "forever", True)


def test_file_pickers_list_comfyui_model_folders(env, tiny_ltx_23):
    gemma = {i.id: i for i in NODES["LTXMGPU_GemmaLoader"].define_schema().inputs}
    assert gemma["gemma"].options == ["tiny-gemma/", "tiny-gemma-comfy.safetensors"]  # the snapshot's shards hidden
    assert gemma["projection"].options == ["checkpoints/tiny-ltx-2.3.safetensors"]  # no Gemma file offered
    loader = {i.id: i for i in NODES["LTXMGPU_ModelLoader"].define_schema().inputs}
    assert loader["ckpt_name"].options == ["tiny-ltx-2.3.safetensors"]
    assert (bridge.full_path("checkpoints", "tiny-ltx-2.3.safetensors")
            == str(env / "checkpoints" / "tiny-ltx-2.3.safetensors"))
    assert bridge.full_path("checkpoints", str(tiny_ltx_23)) == str(tiny_ltx_23)  # explicit paths work too
    with pytest.raises(FileNotFoundError, match=r"'nope.safetensors' was not found in the checkpoints folder"):
        bridge.full_path("checkpoints", "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="neither models/checkpoints nor models/diffusion_models"):
        denoise_nodes.resolve_checkpoint("nope.safetensors")
    lora = str(env / "loras" / "style.safetensors")
    assert (denoise_nodes.parse_loras("style.safetensors:0.5\n# comment\n\nstyle.safetensors")
            == [(lora, 0.5), (lora, 1.0)])
    with pytest.raises(ValueError, match="strength 'strong' is not a number; write file.safetensors:0.8"):
        denoise_nodes.parse_loras("style.safetensors:strong")


# --------------------------------------------------------------------------- the bridge with ComfyUI present


@pytest.fixture
def fake_comfyui(monkeypatch):
    """Small stand-ins for ComfyUI's modules, registered as ComfyUI registers them."""
    calls = []
    mm = types.ModuleType("comfy.model_management")

    class Interrupt(BaseException):
        pass

    state = {"flag": False, "device": torch.device("cuda", 1)}
    mm.InterruptProcessingException = Interrupt
    mm.interrupt_current_processing = lambda value=True: state.update(flag=value)
    mm.processing_interrupted = lambda: state["flag"]

    def throw():
        if state["flag"]:
            state["flag"] = False
            raise Interrupt()

    mm.throw_exception_if_processing_interrupted = throw
    mm.unload_all_models = lambda: calls.append("unload_all_models")
    mm.soft_empty_cache = lambda force=False: calls.append("soft_empty_cache")
    mm.get_torch_device = lambda: state["device"]
    utils = types.ModuleType("comfy.utils")

    class ProgressBar:
        def __init__(self, total, node_id=None):
            calls.append(("bar", total, node_id))

        def update_absolute(self, value, total=None, preview=None):
            calls.append(("update", value, total))

    utils.ProgressBar = ProgressBar
    nested = types.ModuleType("comfy.nested_tensor")

    class NestedTensor:
        is_nested = True

        def __init__(self, tensors):
            self.tensors = list(tensors)

    nested.NestedTensor = NestedTensor
    for name, mod in {"comfy": types.ModuleType("comfy"), "comfy.model_management": mm, "comfy.utils": utils,
                      "comfy.nested_tensor": nested}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    return types.SimpleNamespace(calls=calls, state=state, Interrupt=Interrupt, NestedTensor=NestedTensor)


def test_bridge_uses_comfyui_when_it_is_loaded(fake_comfyui, env):
    assert bridge.interrupt_exception() is fake_comfyui.Interrupt
    bridge.interrupt_current_processing(True)
    assert fake_comfyui.state["flag"] and bridge.processing_interrupted()
    with pytest.raises(fake_comfyui.Interrupt):
        bridge.raise_interrupt()
    assert not fake_comfyui.state["flag"]
    with pytest.raises(fake_comfyui.Interrupt):  # raised even when the flag was already cleared
        bridge.raise_interrupt()
    bar = bridge.progress_bar(4, "21")
    bar.update_absolute(2, 4)
    assert fake_comfyui.calls[:2] == [("bar", 4, "21"), ("update", 2, 4)]
    out = bridge.to_comfy_latent(av_latent())
    assert type(out["samples"]) is fake_comfyui.NestedTensor and type(out["noise_mask"]) is fake_comfyui.NestedTensor
    assert bridge.comfy_cuda_index() == 5  # cuda:1 through CUDA_VISIBLE_DEVICES=3,5


def test_free_comfy_vram_only_when_the_pool_shares_comfyuis_gpu(fake_comfyui, env):
    shared = runtime.PoolHandle(gpus="1", cpu_ranks=1, free_comfy_vram=True)  # physical GPU 5 through 3,5
    shared.session()._prepare()
    assert fake_comfyui.calls == ["unload_all_models", "soft_empty_cache"]
    fake_comfyui.calls.clear()
    runtime.PoolHandle(gpus="0", cpu_ranks=1, free_comfy_vram=True).before_job()  # physical 3: not ComfyUI's
    runtime.PoolHandle(gpus="1", cpu_ranks=1, free_comfy_vram=False).before_job()
    runtime.PoolHandle(gpus="cpu", cpu_ranks=2, free_comfy_vram=True).before_job()
    fake_comfyui.state["device"] = torch.device("cpu")  # ComfyUI itself on the CPU (--cpu)
    shared.before_job()
    assert fake_comfyui.calls == []


def test_fallback_nested_tensor_behaves_like_comfyuis():
    v, a = torch.zeros(1, 128, 2, 2, 3), torch.ones(1, 8, 5, 16)
    nt = bridge.make_nested([v, a])
    assert bridge.is_nested(nt) and nt.shape == v.shape and nt.dtype == v.dtype and nt.unbind()[1] is a
    assert [t.dtype for t in nt.to(torch.float16).tensors] == [torch.float16] * 2
    assert not bridge.is_nested(v) and math.isnan(NODES["LTXMGPU_PoolStatus"].fingerprint_inputs())


def test_the_projection_picker_lists_checkpoints_and_projection_files_not_gemma(tmp_path, monkeypatch):
    """A projection comes from an LTX-2 checkpoint or a projection file; the Gemma files beside
    them in ``text_encoders`` (by name, or inside a Gemma snapshot directory) are not offered."""
    text = sys.modules[f"{PACK_MODULE.__name__}.nodes.text"]
    models = tmp_path / "models"
    for rel in ("checkpoints/ltx-2.3-22b-dev.safetensors", "text_encoders/gemma_3_12B_it_fp4_mixed.safetensors",
                "text_encoders/ltx-2-19b-embeddings_connector_dev_bf16.safetensors",
                "text_encoders/my-snapshot/model.safetensors", "text_encoders/my-snapshot/config.json"):
        (models / rel).parent.mkdir(parents=True, exist_ok=True)
        (models / rel).write_bytes(b"")
    monkeypatch.setenv("LTX_MGPU_MODELS_DIR", str(models))
    assert text.projection_choices() == ["checkpoints/ltx-2.3-22b-dev.safetensors",
                                         "text_encoders/ltx-2-19b-embeddings_connector_dev_bf16.safetensors"]
    assert "gemma_3_12B_it_fp4_mixed.safetensors" in text.gemma_choices() and "my-snapshot/" in text.gemma_choices()
