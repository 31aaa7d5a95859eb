"""The ComfyUI nodes without ComfyUI (the bridge's fallbacks), through a real 2-rank CPU pool.

* Contract: every node's INPUT_TYPES / RETURN_TYPES is well formed, ids carry the LTXMGPU
  prefix, every input has a tooltip, defaults lie within their ranges and choices.
* Loading: the pack imports the way ComfyUI imports it, and on a platform where the pool cannot
  run (no fcntl, not Linux) the nodes still load and say why on use.
* Execution with the tiny models (``ltx_mgpu.assets``) under ``torch.inference_mode`` as in
  ComfyUI: Pool -> Gemma Loader -> Prompt Encode (ComfyUI's LTX-2 CONDITIONING, equal to the
  in-process encoder, cached the second time without contacting the pool) -> Model Loader ->
  SP Sampler (the LATENT equals ``remote_sample``'s, in the bridge's NestedTensor class, progress
  on the node id); Prompt Batch Encode, keep_loaded off, Pool Status, Free, the routes' payloads.
* Stop: an interrupt raised mid-sampling (flag only, or raised by the progress hook as
  ComfyUI's does) makes the node raise the interrupt exception, a BaseException, after the pool
  confirmed the cancel; the same pool then samples again.
* The bridge with ComfyUI present: ComfyUI's own interrupt, ProgressBar(node_id=...),
  NestedTensor and unload functions are the ones used (ComfyUI stood in by small modules).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from pool_support import cleanup, short_dir
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
PACK = "ltx_mgpu_pack_under_test"
PROMPTS = ("a red fox running through snow at dawn", "blurry, low quality")
pytestmark = pytest.mark.slow


def load_pack():
    """Import the pack the way ComfyUI does (a file location under a mangled module name)."""
    if PACK in sys.modules:
        return sys.modules[PACK]
    spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = module
    spec.loader.exec_module(module)
    return module


PACK_MODULE = load_pack()
NODES = PACK_MODULE.NODE_CLASS_MAPPINGS
bridge = sys.modules[f"{PACK}.nodes._comfy"]
runtime = sys.modules[f"{PACK}.nodes._runtime"]
routes = sys.modules[f"{PACK}.nodes.routes"]
denoise_nodes = sys.modules[f"{PACK}.nodes.denoise"]


def node(name):
    return NODES[name]()


class DuckNested:
    """A NestedTensor-shaped object that is not the bridge's class (as another pack might pass)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)


def av_latent(nested=DuckNested, seed=11):
    g = torch.Generator().manual_seed(seed)
    video, audio = torch.randn(1, 128, 2, 2, 3, generator=g), torch.randn(1, 8, 5, 16, generator=g)
    vmask, amask = torch.ones(1, 1, 2, 1, 1), torch.ones(1, 1, 5, 1)
    vmask[:, :, 0] = 0.0
    return {"samples": nested([video, audio]), "noise_mask": nested([vmask, amask]), "type": "audio", "kept": "yes"}


def parts(latent):
    s = latent["samples"]
    return list(s.tensors) if bridge.is_nested(s) else [s]


class Progress:
    """The fallback progress hook: records (node_id, value, total); ``on`` runs per update."""

    def __init__(self, on=None):
        self.events, self.on = [], on

    def __call__(self, node_id, value, total):
        self.events.append((node_id, value, total))
        if self.on is not None:
            self.on(len(self.events))


@pytest.fixture
def progress():
    rec = Progress()
    bridge.set_progress_hook(rec)
    yield rec
    bridge.set_progress_hook(None)
    bridge.interrupt_current_processing(False)


# --------------------------------------------------------------------------- environment


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_gemma_dir, tiny_gemma_comfy_file, tiny_ltx_23):
    """ComfyUI-like model folders ($LTX_MGPU_MODELS_DIR), a private pool runtime dir and cache."""
    models = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "text_encoders", "loras", "diffusion_models"):
        (models / folder).mkdir()
    (models / "checkpoints" / "tiny-ltx-2.3.safetensors").symlink_to(tiny_ltx_23)
    (models / "text_encoders" / "tiny-gemma").symlink_to(tiny_gemma_dir, target_is_directory=True)
    (models / "text_encoders" / "tiny-gemma-comfy.safetensors").symlink_to(tiny_gemma_comfy_file)
    save_file({"diffusion_model.x.lora_A.weight": torch.zeros(2, 2)}, str(models / "loras" / "style.safetensors"))
    base = short_dir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LTX_MGPU_MODELS_DIR", str(models))
        mp.setenv("LTX_MGPU_RUNTIME_DIR", str(base))
        mp.setenv("LTX_MGPU_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield models
    cleanup(base)


@pytest.fixture(scope="module")
def pool(env):
    handle = node("LTXMGPU_Pool").make("cpu", 2, "with-owner", True)[0]
    yield handle
    handle.client.shutdown()


@pytest.fixture(scope="module")
def text_encoder(pool):
    return node("LTXMGPU_GemmaLoader").load(pool, "tiny-gemma/", "checkpoints/tiny-ltx-2.3.safetensors", "bf16",
                                            "single", True)[0]


@pytest.fixture(scope="module")
def model(pool):
    return node("LTXMGPU_ModelLoader").load(pool, "tiny-ltx-2.3.safetensors", "fp32", "", 32768, unique_id="8")[0]


@pytest.fixture(scope="module")
def conds(text_encoder):
    with torch.inference_mode():
        return node("LTXMGPU_PromptEncode").encode(text_encoder, *PROMPTS, True, unique_id="7")


# --------------------------------------------------------------------------- contract and loading


def test_every_node_declares_a_valid_contract():
    assert set(NODES) == {"LTXMGPU_Pool", "LTXMGPU_PoolStatus", "LTXMGPU_Free", "LTXMGPU_GemmaLoader",
                          "LTXMGPU_PromptEncode", "LTXMGPU_PromptBatchEncode", "LTXMGPU_ModelLoader",
                          "LTXMGPU_SPSampler"}
    names = PACK_MODULE.NODE_DISPLAY_NAME_MAPPINGS
    for nid, cls in NODES.items():
        assert nid.startswith("LTXMGPU_") and names[nid].startswith("LTX-2 Multi-GPU ")
        assert cls.CATEGORY == "LTX-2 Multi-GPU" and callable(getattr(cls(), cls.FUNCTION))
        assert isinstance(cls.RETURN_TYPES, tuple) and len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES)
        assert len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES) and cls.DESCRIPTION
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"} and spec["required"]
        for section in ("required", "optional"):
            for name, entry in spec.get(section, {}).items():
                kind, opts = entry[0], entry[1]
                assert opts.get("tooltip"), f"{nid}.{name} has no tooltip"
                if isinstance(kind, list):
                    assert "default" not in opts or opts["default"] in kind, f"{nid}.{name}"
                elif kind in ("INT", "FLOAT"):
                    assert opts["min"] <= opts["default"] <= opts["max"], f"{nid}.{name}"
                elif kind == "BOOLEAN":
                    assert isinstance(opts["default"], bool)
                elif kind == "STRING":
                    assert isinstance(opts["default"], str)
                else:
                    assert kind.isupper(), f"{nid}.{name}: {kind}"
        for name, value in spec.get("hidden", {}).items():
            assert value == "UNIQUE_ID" and name == "unique_id"
    # node ids the pool reports progress for take the hidden id
    for nid in ("LTXMGPU_PromptEncode", "LTXMGPU_PromptBatchEncode", "LTXMGPU_ModelLoader", "LTXMGPU_SPSampler"):
        assert "unique_id" in NODES[nid].INPUT_TYPES()["hidden"]


def test_sampler_names_match_the_pool():
    from ltx_mgpu.denoise.sampler import SAMPLERS

    assert tuple(denoise_nodes.SAMPLERS) == tuple(SAMPLERS)


def test_nodes_load_where_the_pool_cannot_run_and_say_why_on_use():
    script = f"""
import importlib.util, sys
import torch                         # (torch itself imported on the real platform)
sys.modules["fcntl"] = None          # as on Windows: the pool's runtime module cannot import
sys.platform = "win32"
spec = importlib.util.spec_from_file_location("pack", {str(REPO / '__init__.py')!r},
                                              submodule_search_locations=[{str(REPO)!r}])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
print(len(pack.NODE_CLASS_MAPPINGS))
for cls in pack.NODE_CLASS_MAPPINGS.values():
    cls.INPUT_TYPES()
try:
    pack.NODE_CLASS_MAPPINGS["LTXMGPU_Pool"]().make("all", 1, "with-owner", True)
except RuntimeError as e:
    print("ERROR", e)
print(sys.modules["pack.nodes.routes"].status_payload()["message"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "8"
    assert lines[1].startswith("ERROR LTX-2 Multi-GPU: the multi-GPU pool runs on Linux only (this is win32)")
    assert "Linux only" in lines[2]


def test_no_torch_distributed_is_a_clear_error(monkeypatch):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no torch.distributed, which the pool needs"):
        node("LTXMGPU_Pool").make("cpu", 1, "with-owner", True)


def test_bad_pool_settings_name_the_fix():
    with pytest.raises(ValueError, match="gpus must be 'all', 'cpu' or a list like '0,1'"):
        node("LTXMGPU_Pool").make("first two", 1, "with-owner", True)
    with pytest.raises(ValueError, match="lifetime must be one of"):
        node("LTXMGPU_Pool").make("cpu", 1, "forever", True)


def test_file_pickers_list_comfyui_model_folders(env, tiny_ltx_23):
    gemma = NODES["LTXMGPU_GemmaLoader"].INPUT_TYPES()["required"]
    assert gemma["gemma"][0] == ["tiny-gemma/", "tiny-gemma-comfy.safetensors"]  # the snapshot's shards are hidden
    assert gemma["projection"][0] == ["checkpoints/tiny-ltx-2.3.safetensors", "text_encoders/tiny-gemma-comfy.safetensors"]
    assert NODES["LTXMGPU_ModelLoader"].INPUT_TYPES()["required"]["ckpt_name"][0] == ["tiny-ltx-2.3.safetensors"]
    assert bridge.full_path("checkpoints", "tiny-ltx-2.3.safetensors") == str(env / "checkpoints" / "tiny-ltx-2.3.safetensors")
    assert bridge.full_path("checkpoints", str(tiny_ltx_23)) == str(tiny_ltx_23)  # explicit paths work too
    with pytest.raises(FileNotFoundError, match=r"'nope.safetensors' was not found in the checkpoints folder"):
        bridge.full_path("checkpoints", "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="neither models/checkpoints nor models/diffusion_models"):
        denoise_nodes.resolve_checkpoint("nope.safetensors")
    lora = str(env / "loras" / "style.safetensors")
    assert denoise_nodes.parse_loras("style.safetensors:0.5\n# comment\n\nstyle.safetensors") == [(lora, 0.5), (lora, 1.0)]
    with pytest.raises(ValueError, match="strength 'strong' is not a number; write file.safetensors:0.8"):
        denoise_nodes.parse_loras("style.safetensors:strong")


def test_gemma_loader_rejects_a_file_that_is_not_gemma(pool):
    from ltx_mgpu.text.gemma_sources import GemmaFormatError

    with pytest.raises(GemmaFormatError, match="Supported Gemma 3 formats"):
        node("LTXMGPU_GemmaLoader").load(pool, str(Path(os.environ["LTX_MGPU_MODELS_DIR"]) / "loras" / "style.safetensors"),
                                         "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True)


# --------------------------------------------------------------------------- execution through the pool


def test_prompt_encode_gives_comfyui_ltx2_conditioning_and_hits_the_cache(text_encoder, conds, progress):
    reference = text_encoder.encoder.text_spec().build().encode(list(PROMPTS), batch_size=8)
    for cond, ref in zip(conds, reference):
        assert isinstance(cond, list) and len(cond) == 1
        tensor, options = cond[0]
        assert options == {"pooled_output": None, "unprocessed_ltxav_embeds": True}
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.shape == (1, *ref.tensor.shape)
        torch.testing.assert_close(tensor[0], ref.tensor, rtol=2e-2, atol=2e-2)
    with torch.inference_mode():
        again = node("LTXMGPU_PromptEncode").encode(text_encoder, *PROMPTS, True, unique_id="7")
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(again, conds))
    assert progress.events == [("7", 1.0, 1.0)]  # cached: no pool progress, only the node's final tick


def test_sp_sampler_returns_the_pool_latent_in_comfyui_form(pool, model, conds, progress):
    from ltx_mgpu.remote_denoise import remote_sample

    pos, neg = conds
    latent = av_latent()
    with torch.inference_mode():
        (out,) = node("LTXMGPU_SPSampler").sample(model, pos, neg, latent, 3, 2.0, 5, "euler", unique_id="9")
    ref = remote_sample(pool.client, pos, neg, latent, steps=3, cfg=2.0, seed=5)
    assert type(out["samples"]) is bridge.nested_tensor_type() and type(out["noise_mask"]) is bridge.nested_tensor_type()
    assert [p.shape for p in parts(out)] == [p.shape for p in parts(latent)]
    assert all(torch.equal(a, b) for a, b in zip(parts(out), parts(ref)))
    assert all((a - b).abs().max() > 0.1 for a, b in zip(parts(out), parts(latent)))  # it denoised
    assert out["kept"] == "yes" and out["type"] == "audio"
    assert [e for e in progress.events if e[0] == "9"] == [("9", 1.0, 3.0), ("9", 2.0, 3.0), ("9", 3.0, 3.0)]


def test_sp_sampler_takes_comfyui_sigmas_and_plain_video_latents(model, conds):
    from ltx_mgpu.remote_denoise import remote_sample

    sigmas = torch.tensor([1.0, 0.725, 0.421875, 0.0])
    latent = {"samples": torch.randn(1, 128, 2, 2, 3, generator=torch.Generator().manual_seed(3))}
    with torch.inference_mode():
        (out,) = node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], latent, 99, 1.0, 7, "euler", sigmas=sigmas)
    ref = remote_sample(model.pool.client, conds[0], None, latent, sigmas=sigmas, seed=7)
    assert isinstance(out["samples"], torch.Tensor) and torch.equal(out["samples"], ref["samples"])


@pytest.mark.parametrize("how", ["flag", "hook_raises"])
def test_stop_mid_sampling_raises_comfyui_interrupt_and_the_pool_keeps_serving(pool, model, conds, how):
    def on(n):
        if n == 2:
            bridge.interrupt_current_processing(True)
            if how == "hook_raises":  # ComfyUI's progress hook clears the flag and raises
                bridge.interrupt_current_processing(False)
                raise bridge.InterruptProcessingException()

    rec = Progress(on)
    bridge.set_progress_hook(rec)
    pid = pool.client.pid
    try:
        with pytest.raises(bridge.InterruptProcessingException) as e:
            node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 300, 1.0, 1, "euler",
                                             unique_id="11")
    finally:
        bridge.set_progress_hook(None)
    assert not isinstance(e.value, Exception) and isinstance(e.value, BaseException)
    assert 2 <= len(rec.events) < 300 and not bridge.processing_interrupted()
    (out,) = node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 2, 1.0, 1, "euler")
    assert pool.client.pid == pid and [p.shape for p in parts(out)] == [p.shape for p in parts(av_latent())]


def test_bad_latent_is_a_clear_node_error_and_the_pool_keeps_serving(model, conds):
    from ltx_mgpu.client import BadInputError

    with pytest.raises(BadInputError, match="LTX-2 video latent is"):
        node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], {"samples": torch.zeros(1, 4, 8, 8)}, 2, 1.0, 0,
                                         "euler")
    (out,) = node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 1, 1.0, 0, "euler")
    assert len(parts(out)) == 2


def test_model_is_loaded_again_when_the_pool_freed_it(pool, model, conds):
    (text,) = node("LTXMGPU_Free").free(pool, False)["result"]
    assert text.startswith("pool on CPU (2 ranks): unloaded") and "ltx" in text
    assert not pool.client.status()["ranks"][0]["models"]
    (out,) = node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 1, 1.0, 0, "euler")
    assert len(parts(out)) == 2 and "ltx" in pool.client.status()["ranks"][0]["models"]


def test_prompt_batch_encode_fills_the_cache_and_keep_loaded_off_unloads_gemma(pool, progress):
    te = node("LTXMGPU_GemmaLoader").load(pool, "tiny-gemma-comfy.safetensors", "checkpoints/tiny-ltx-2.3.safetensors",
                                          "bf16", "single", False)[0]
    prompts = "a lighthouse in a storm\n\ntwo cats\na lighthouse in a storm\nwater"
    first = node("LTXMGPU_PromptBatchEncode").encode(te, prompts, 2, unique_id="12")
    text = first["result"][0]
    assert first["ui"]["text"] == [text] and text.startswith("3 prompts: 0 cached, 3 encoded")
    assert os.environ["LTX_MGPU_CACHE_DIR"] in text
    assert any(e[0] == "12" and e[1] < e[2] for e in progress.events)  # pool progress reached the node
    assert "text_encoder" not in pool.client.status()["ranks"][0]["models"]
    second = node("LTXMGPU_PromptBatchEncode").encode(te, prompts, 2, unique_id="12")["result"][0]
    assert second.startswith("3 prompts: 3 cached, 0 encoded")
    with pytest.raises(ValueError, match="no prompts; write one prompt per line"):
        node("LTXMGPU_PromptBatchEncode").encode(te, " \n\n", 2)


def test_pool_status_routes_and_free(pool, model, conds, env):
    node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 1, 1.0, 0, "euler")  # ltx resident
    text = node("LTXMGPU_PoolStatus").report(pool)["result"][0]
    assert "2 rank(s) on cpu" in text and "ltx (" in text and "running: -" in text
    payload = routes.status_payload()
    assert payload["available"] and payload["message"] is None
    entry = next(p for p in payload["pools"] if p["key"] == "cpu-2")
    assert entry["state"] == "idle" and entry["current"] is None and len(entry["ranks"]) == 2
    assert all(r["memory"]["rss"] > 0 and r["memory"]["total"] > 0 for r in entry["ranks"])
    assert "ltx" in entry["ranks"][0]["models"]
    freed = routes.free_payload()
    assert "ltx" in next(p for p in freed["pools"] if p["key"] == "cpu-2")["unloaded"]
    idle = node("LTXMGPU_Pool").make("cpu", 3, "with-owner", True)[0]  # configured, never started
    assert node("LTXMGPU_PoolStatus").report(idle)["result"][0] == (
        "pool on CPU (3 ranks): not running (it starts with the first job that needs it)")
    assert node("LTXMGPU_Free").free(idle, True)["result"][0] == "pool on CPU (3 ranks): not running, nothing to free"


def test_stop_pool_then_the_next_node_run_starts_a_fresh_pool(pool, model, conds):
    old = pool.client.pid
    assert node("LTXMGPU_Free").free(pool, True)["result"][0] == "pool on CPU (2 ranks): stopped"
    assert next(p for p in routes.status_payload()["pools"] if p["key"] == "cpu-2")["state"] == "not running"
    (out,) = node("LTXMGPU_SPSampler").sample(model, conds[0], conds[1], av_latent(), 1, 1.0, 0, "euler")
    assert len(parts(out)) == 2 and pool.client.pid != old


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
    assert not bridge.is_nested(v) and math.isnan(NODES["LTXMGPU_PoolStatus"].IS_CHANGED())
