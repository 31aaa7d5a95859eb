"""The ComfyUI nodes without ComfyUI (the bridge's fallbacks), through a real 2-rank CPU pool.

* Execution with the tiny models (``ltx_mgpu.assets``) under ``torch.inference_mode`` as in
  ComfyUI: Pool -> Gemma Loader -> Prompt Encode (ComfyUI's LTX-2 CONDITIONING, equal to the
  in-process encoder, cached the second time without contacting the pool) -> Model Loader ->
  SP Sampler (the LATENT equals ``remote_sample``'s, in the bridge's NestedTensor class, progress
  on the node id); Prompt Batch Encode, keep_loaded off, Pool Status, Free, the routes' payloads.
* Stop: an interrupt raised mid-sampling (flag only, or raised by the progress hook as
  ComfyUI's does) makes the node raise the interrupt exception, a BaseException, after the pool
  confirmed the cancel; the same pool then samples again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from nodes_support import av_latent, bridge, cpu_pool, routes, run

from ltx_mgpu.text.encoder.local import LocalTextEncoder

PROMPTS = ("a red fox running through snow at dawn", "blurry, low quality")


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
def pool(env):
    with cpu_pool() as handle:
        yield handle


@pytest.fixture(scope="module")
def text_encoder(pool):
    return run("LTXMGPU_GemmaLoader", pool, "tiny-gemma/", "checkpoints/tiny-ltx-2.3.safetensors", "bf16",
                                            "single", True)[0]


@pytest.fixture(scope="module")
def model(pool):
    return run("LTXMGPU_ModelLoader", pool, "tiny-ltx-2.3.safetensors", "fp32", "", 32768, unique_id="8")[0]


@pytest.fixture(scope="module")
def conds(text_encoder):
    with torch.inference_mode():
        return run("LTXMGPU_PromptEncode", text_encoder, *PROMPTS, True, unique_id="7")


# --------------------------------------------------------------------------- execution through the pool


def test_gemma_loader_rejects_a_file_that_is_not_gemma(pool):
    from ltx_mgpu.text.gemma.sources import GemmaFormatError

    with pytest.raises(GemmaFormatError, match="Supported Gemma 3 formats"):
        run("LTXMGPU_GemmaLoader", pool,
                                         str(Path(os.environ["LTX_MGPU_MODELS_DIR"]) / "loras" / "style.safetensors"),
                                         "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True)


def test_prompt_encode_gives_comfyui_ltx2_conditioning_and_hits_the_cache(text_encoder, conds, progress):
    reference = LocalTextEncoder(text_encoder.config).build().encode(list(PROMPTS), batch_size=8)
    for cond, ref in zip(conds, reference):
        assert isinstance(cond, list) and len(cond) == 1
        tensor, options = cond[0]
        assert options == {"pooled_output": None, "unprocessed_ltxav_embeds": True}
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.shape == (1, *ref.tensor.shape)
        torch.testing.assert_close(tensor[0], ref.tensor, rtol=2e-2, atol=2e-2)
    with torch.inference_mode():
        again = run("LTXMGPU_PromptEncode", text_encoder, *PROMPTS, True, unique_id="7")
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(again, conds))
    assert progress.events == [("7", 1.0, 1.0)]  # cached: no pool progress, only the node's final tick


def test_sp_sampler_returns_the_pool_latent_in_comfyui_form(pool, model, conds, progress):
    from ltx_mgpu.client.denoise import SampleRequest, remote_sample

    pos, neg = conds
    latent = av_latent()
    with torch.inference_mode():
        (out,) = run("LTXMGPU_SPSampler", model, pos, neg, latent, 3, 2.0, 5, "euler", unique_id="9")
    ref = remote_sample(pool.client, SampleRequest(pos, neg, latent, steps=3, cfg=2.0, seed=5))
    assert (type(out["samples"]) is bridge.nested_tensor_type()
            and type(out["noise_mask"]) is bridge.nested_tensor_type())
    assert [p.shape for p in parts(out)] == [p.shape for p in parts(latent)]
    assert all(torch.equal(a, b) for a, b in zip(parts(out), parts(ref)))
    assert all((a - b).abs().max() > 0.1 for a, b in zip(parts(out), parts(latent)))  # it denoised
    assert out["kept"] == "yes" and out["type"] == "audio"
    assert [e for e in progress.events if e[0] == "9"] == [("9", 1.0, 3.0), ("9", 2.0, 3.0), ("9", 3.0, 3.0)]


def test_sp_sampler_takes_comfyui_sigmas_and_plain_video_latents(model, conds):
    from ltx_mgpu.client.denoise import SampleRequest, remote_sample

    sigmas = torch.tensor([1.0, 0.725, 0.421875, 0.0])
    latent = {"samples": torch.randn(1, 128, 2, 2, 3, generator=torch.Generator().manual_seed(3))}
    with torch.inference_mode():
        (out,) = run("LTXMGPU_SPSampler", model, conds[0], conds[1], latent, 99, 1.0, 7, "euler", sigmas=sigmas)
    ref = remote_sample(model.pool.client, SampleRequest(conds[0], None, latent, sigmas=sigmas, seed=7))
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
            run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 300, 1.0, 1, "euler",
                                             unique_id="11")
    finally:
        bridge.set_progress_hook(None)
    assert not isinstance(e.value, Exception) and isinstance(e.value, BaseException)
    assert 2 <= len(rec.events) < 300 and not bridge.processing_interrupted()
    (out,) = run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 2, 1.0, 1, "euler")
    assert pool.client.pid == pid and [p.shape for p in parts(out)] == [p.shape for p in parts(av_latent())]


def test_bad_latent_is_a_clear_node_error_and_the_pool_keeps_serving(model, conds):
    from ltx_mgpu.client.errors import BadInputError

    with pytest.raises(BadInputError, match="LTX-2 video latent is"):
        run("LTXMGPU_SPSampler", model, conds[0], conds[1], {"samples": torch.zeros(1, 4, 8, 8)}, 2, 1.0, 0,
                                         "euler")
    (out,) = run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 2, 1.0, 0, "euler")
    assert len(parts(out)) == 2


def test_model_is_loaded_again_when_the_pool_freed_it(pool, model, conds):
    (text,) = run("LTXMGPU_Free", pool, False).result
    assert text.startswith("pool on CPU (2 ranks): unloaded") and "ltx" in text
    assert not pool.client.status()["ranks"][0]["models"]
    (out,) = run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 2, 1.0, 0, "euler")
    assert len(parts(out)) == 2 and "ltx" in pool.client.status()["ranks"][0]["models"]


def test_prompt_batch_encode_fills_the_cache_and_keep_loaded_off_unloads_gemma(pool, progress):
    te = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma-comfy.safetensors", "checkpoints/tiny-ltx-2.3.safetensors",
                                          "bf16", "single", False)[0]
    prompts = "a lighthouse in a storm\n\ntwo cats\na lighthouse in a storm\nwater"
    first = run("LTXMGPU_PromptBatchEncode", te, prompts, 2, unique_id="12")
    text = first.result[0]
    assert first.ui["text"] == [text] and text.startswith("3 prompts: 0 cached, 3 encoded")
    assert os.environ["LTX_MGPU_CACHE_DIR"] in text
    assert any(e[0] == "12" and e[1] < e[2] for e in progress.events)  # pool progress reached the node
    assert "text_encoder" not in pool.client.status()["ranks"][0]["models"]
    second = run("LTXMGPU_PromptBatchEncode", te, prompts, 2, unique_id="12").result[0]
    assert second.startswith("3 prompts: 3 cached, 0 encoded")
    with pytest.raises(ValueError, match="no prompts; write one prompt per line"):
        run("LTXMGPU_PromptBatchEncode", te, " \n\n", 2)


def test_pool_status_routes_and_free(pool, model, conds, env):
    run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 2, 1.0, 0, "euler")  # ltx resident
    text = run("LTXMGPU_PoolStatus", pool).result[0]
    assert "2 rank(s) on cpu" in text and "ltx (" in text and "running: -" in text
    payload = routes.status_payload()
    assert payload["available"] and payload["message"] is None
    entry = next(p for p in payload["pools"] if p["dir"] == str(pool.spec.dir))  # other tests' pools may be listed
    assert entry["state"] == "idle" and entry["current"] is None and len(entry["ranks"]) == 2
    assert all(r["memory"]["rss"] > 0 and r["memory"]["total"] > 0 for r in entry["ranks"])
    assert "ltx" in entry["ranks"][0]["models"]
    freed = routes.free_payload()
    assert any("ltx" in p["unloaded"] for p in freed["pools"] if p["key"] == "cpu-2")
    idle = run("LTXMGPU_Pool", "cpu", 3, "with-owner", True)[0]  # configured, never started
    assert run("LTXMGPU_PoolStatus", idle).result[0] == (
        "pool on CPU (3 ranks): not running (it starts with the first job that needs it)")
    assert run("LTXMGPU_Free", idle, True).result[0] == "pool on CPU (3 ranks): not running, nothing to free"


def test_stop_pool_then_the_next_node_run_starts_a_fresh_pool(pool, model, conds):
    old = pool.client.pid
    assert run("LTXMGPU_Free", pool, True).result[0] == "pool on CPU (2 ranks): stopped"
    assert next(p for p in routes.status_payload()["pools"] if p["dir"] == str(pool.spec.dir))["state"] == "not running"
    (out,) = run("LTXMGPU_SPSampler", model, conds[0], conds[1], av_latent(), 2, 1.0, 0, "euler")
    assert len(parts(out)) == 2 and pool.client.pid != old
