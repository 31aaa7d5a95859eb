"""The MODEL path through a real 2-rank CPU pool (``ltx_mgpu.client.model`` ->
``ltx_mgpu.pool.model_jobs``): ComfyUI's sampler would call these once per model evaluation.

* ``text_contexts`` equals the connectors in process; ``forward`` on two ranks (sequence
  parallel) equals the same call in process at world size 1, for audio-video latents with
  scalar and per-token timesteps, a video-only latent, and both AV timestep conventions;
* the text context goes over the wire once per run, and again only when the pool dropped it;
* ComfyUI's LoRA patches (plain LoRA adapters, diffs; stacked, strength 0.5 and -1) equal the
  Model Loader's own LoRA list, removing them restores the loaded weights bit for bit, and a
  second MODEL with other patches on the same resident model is honoured call by call;
* what the pool cannot honour is refused by name: LyCORIS adapters, offsets, keys that match
  nothing, keyword arguments of nodes the pool does not implement; a model the pool freed is
  loaded again;
* a call names the model it was made for: another one loaded under the same name since is
  never run in its place.

The ComfyUI side (the MODEL object and ComfyUI's own samplers) is in ``test_comfyui_model.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.client.model import PatchFormatError, PoolModel, wire_patches
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.denoise.forward import av_timestep_convention, comfy_forward, processed_context
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.nested import NestedTensorLike

pytestmark = pytest.mark.slow

F32 = torch.float32
TOL = 1e-5
Q = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
K = "diffusion_model.transformer_blocks.1.video_to_audio_attn.to_k.weight"


@dataclasses.dataclass(eq=False)
class Lora:
    """ComfyUI's ``LoRAAdapter`` as the client sees it (``name``, ``weights``)."""

    weights: tuple
    name: str = "lora"


def _factors(seed: int) -> dict:
    """ComfyUI-named LoRA factors for two weights of the tiny 2.3 model: key -> (up, down)."""
    g = torch.Generator().manual_seed(seed)
    return {Q: (0.5 * torch.randn(32, 2, generator=g), torch.randn(2, 32, generator=g)),
            K: (0.5 * torch.randn(16, 2, generator=g), torch.randn(2, 32, generator=g))}


def _lora_file(path, factors: dict) -> str:
    from safetensors.torch import save_file

    sd = {}
    for key, (up, down) in factors.items():
        stem = key[: -len(".weight")]
        sd[f"{stem}.lora_A.weight"], sd[f"{stem}.lora_B.weight"] = down, up
    save_file(sd, str(path))
    return str(path)


def _patches(*loras: tuple[dict, dict, float]) -> dict:
    """ComfyUI ``ModelPatcher.patches`` for LoRAs ``(factors, adapters by key, strength)``."""
    out: dict = {}
    for factors, adapters, strength in loras:
        for key in factors:
            out.setdefault(key, []).append((strength, adapters[key], 1.0, None, None))
    return out


def _adapters(factors: dict) -> dict:
    return {k: Lora((up, down, None, None, None, None)) for k, (up, down) in factors.items()}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pool(base, tiny_ltx_23):
    client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="with-owner", startup_timeout=120)
    try:
        yield client
    finally:
        client.shutdown()


def _model(pool, checkpoint, name="ltx", loras=(), av="scaled") -> PoolModel:
    load = lambda: remote_load_transformer(pool, str(checkpoint), dtype="fp32", name=name,  # noqa: E731
                                           loras=list(loras), timeout=120)
    loaded = load()
    return PoolModel(lambda: pool, load, name=name, av_timestep=av, key=loaded["key"])


@pytest.fixture(scope="module")
def model(pool, tiny_ltx_23):
    return _model(pool, tiny_ltx_23)


@pytest.fixture(scope="module")
def local(tiny_ltx_23):
    return load_ltx_model(tiny_ltx_23, dtype=F32)


def _text(seed: int, tokens: int = 9) -> torch.Tensor:
    return torch.randn(1, tokens, 48, generator=torch.Generator().manual_seed(seed))


def _inputs(batch=2, f=3, h=3, w=5, n=7, seed=11, audio=True):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, 128, f, h, w, generator=g)
    x = [video, torch.randn(batch, 8, n, 16, generator=g)] if audio else video
    return x, (torch.full((batch,), 0.7), torch.full((batch,), 0.7))


def _context(local, batch=2) -> torch.Tensor:
    return torch.cat([processed_context(local, _text(i), True) for i in range(batch)])


def _reference(local, x, t, ctx, av="scaled", **kw):
    with torch.no_grad(), av_timestep_convention(local.transformer, av):
        return comfy_forward(local, local.transformer, x, t, ctx, **kw)


def _diff(a, b) -> float:
    a, b = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
    assert [t.shape for t in a] == [t.shape for t in b]
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


# --------------------------------------------------------------------------- parity


def test_text_contexts_equal_the_connectors_in_process(model, local):
    text = _text(3, tokens=11)
    got = model.text_contexts(text, True)
    want = processed_context(local, text, True)
    assert got.shape == want.shape and got.shape[-1] == 48 and got.dtype == F32  # registers pad it to 1024
    assert _diff(got, want) <= TOL


@pytest.mark.parametrize("case", ["av", "av_per_token", "av_raw", "video_only"])
def test_forward_on_two_ranks_equals_the_call_in_process(model, local, case):
    x, t = _inputs(audio=case != "video_only")
    if case == "av_per_token":  # image-to-video: frame 0 kept (ComfyUI's patchified mask x sigma)
        v = torch.full((2, 45, 1), 0.7)
        v[:, :15] = 0.0
        t = (v, torch.full((2, 7, 1), 0.7))
    av = "raw" if case == "av_raw" else "scaled"
    ctx = _context(local)
    want = _reference(local, x, t, ctx, av=av, frame_rate=24.0)
    pm = PoolModel(model.client, model.load, model.name, av_timestep=av)
    got = pm.forward(x, t, ctx, frame_rate=24.0, kwargs=["denoise_mask"] if case == "av_per_token" else [])
    assert _diff(got, want) <= TOL
    assert type(got) is type(x)
    if case == "av_raw":  # the conventions differ on audio-video latents
        assert _diff(got, _reference(local, x, t, ctx, frame_rate=24.0)) > 1e-4


def test_the_text_context_is_sent_once_per_run(model, local):
    pm = PoolModel(model.client, model.load, model.name)
    x, t = _inputs()
    ctx = _context(local)
    outs = [pm.forward(x, t, ctx.clone()) for _ in range(3)]  # ComfyUI concatenates a fresh batch per step
    assert pm.sent == {"forward": 3, "context": 1}
    assert _diff(outs[0], outs[2]) == 0.0
    pm.forward(x, t, ctx[:1].clone())  # another context (cond alone): sent
    assert pm.sent["context"] == 2


def test_a_context_the_pool_dropped_is_sent_again(model, local):
    a, b = PoolModel(model.client, model.load, model.name), PoolModel(model.client, model.load, model.name)
    x, t = _inputs(batch=1)
    ctx = _context(local, batch=1)
    first = a.forward(x, t, ctx)
    for i in range(5):  # another client fills every context slot of the pool
        b.forward(x, t, _context(local, batch=1) + i + 1)
    again = a.forward(x, t, ctx)
    assert a.sent["context"] == 2 and a.sent["forward"] == 3  # refused once (unknown_context), resent
    assert _diff(first, again) == 0.0


# --------------------------------------------------------------------------- LoRA patches


def test_comfy_lora_patches_equal_the_loaders_own_loras_and_removing_restores(pool, model, local, base, tiny_ltx_23):
    one, two = _factors(1), _factors(2)
    a1, a2 = _adapters(one), _adapters(two)
    x, t = _inputs()
    ctx = _context(local)
    before = model.forward(x, t, ctx)
    for strengths in [(0.5,), (-1.0,), (1.0, 0.5)]:
        files = [(_lora_file(base / f"l{i}.safetensors", f), s) for i, (f, s) in enumerate(zip((one, two), strengths))]
        loaded = _model(pool, tiny_ltx_23, name="ltx_loras", loras=files)
        want = loaded.forward(x, t, ctx)
        patches = _patches(*[(f, a, s) for f, a, s in zip((one, two), (a1, a2), strengths)])
        got = model.forward(x, t, ctx, patches=(f"set-{strengths}", patches))
        assert _diff(got, want) <= 1e-6, strengths
        assert _diff(got, before) > 1e-3
    sent = model.sent.get("model_patches", 0)
    restored = model.forward(x, t, ctx)  # the loader's MODEL again: no patches
    assert model.sent["model_patches"] == sent + 1
    assert _diff(restored, before) == 0.0
    pool.request("unload", {"names": ["ltx_loras"]}, timeout=60)


def test_a_diff_patch_and_a_strength_change_send_no_new_tensors(model, local):
    x, t = _inputs()
    ctx = _context(local)
    diff = 0.01 * torch.randn(32, 32, generator=torch.Generator().manual_seed(4))
    adapters = _adapters(_factors(3))
    base_out = model.forward(x, t, ctx)
    p1 = {Q: [(1.0, adapters[Q], 1.0, None, None), (1.0, ("diff", (diff,)), 1.0, None, None)]}
    p2 = {Q: [(0.25, adapters[Q], 0.5, None, None), (2.0, ("diff", (diff,)), 1.0, None, None)]}
    first, second = model.forward(x, t, ctx, patches=("p1", p1)), model.forward(x, t, ctx, patches=("p2", p2))
    assert _diff(first, base_out) > 1e-3 and _diff(first, second) > 1e-4
    assert set(model._pool_adapters) == {a["adapter"] for a in wire_patches(p2, model._ids).entries[0]["patches"]}
    model.forward(x, t, ctx)


def test_two_models_with_other_patches_on_one_resident_transformer(model, local):
    other = PoolModel(model.client, model.load, model.name)
    x, t = _inputs()
    ctx = _context(local)
    patches = ("lora-a", _patches((_factors(5), _adapters(_factors(5)), 1.0)))
    plain = model.forward(x, t, ctx)
    patched = other.forward(x, t, ctx, patches=patches)
    assert _diff(model.forward(x, t, ctx), plain) == 0.0  # stale_patches: merged back to the loaded weights
    assert _diff(other.forward(x, t, ctx, patches=patches), patched) == 0.0


def test_the_sp_sampler_after_a_patched_forward_samples_the_loaded_weights(pool, model, local):
    x, t = _inputs()
    ctx = _context(local)
    cond = [[_text(1), {"pooled_output": None, "unprocessed_ltxav_embeds": True}]]
    latent = {"samples": NestedTensorLike([torch.randn(1, 128, 2, 2, 3), torch.randn(1, 8, 5, 16)]), "type": "audio"}
    request = SampleRequest(cond, None, latent, sigmas=torch.tensor([1.0, 0.5, 0.0]), seed=3)
    before = remote_sample(pool, request, timeout=120)
    model.forward(x, t, ctx, patches=("lora-b", _patches((_factors(6), _adapters(_factors(6)), 1.0))))
    after = remote_sample(pool, request, timeout=120)
    assert all(torch.equal(p, q) for p, q in zip(before["samples"].tensors, after["samples"].tensors, strict=True))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("patch, match", [
    ((1.0, Lora((torch.ones(4, 2), torch.ones(2, 4)), name="loha"), 1.0, None, None), "'loha' adapter"),
    ((1.0, Lora((torch.ones(4, 2), torch.ones(2, 4), None, torch.ones(2, 2, 1, 1), None, None)), 1.0, None, None),
     "LoCon mid"),
    ((1.0, Lora((torch.ones(4, 2), torch.ones(2, 4), None, None, torch.ones(4), None)), 1.0, None, None), "DoRA"),
    ((1.0, ("diff", (torch.ones(4, 4),)), 1.0, (0, 0, 2), None), "offset"),
    ((1.0, ("set", (torch.ones(4, 4),)), 1.0, None, None), "'set' patch"),
], ids=["loha", "locon_mid", "dora", "offset", "set"])
def test_patches_the_pool_cannot_merge_exactly_are_refused_naming_the_key(patch, match):
    with pytest.raises(PatchFormatError, match=match) as info:
        wire_patches({Q: [patch]}, lambda obj: "id")
    assert Q in str(info.value)


def test_a_patch_for_a_weight_the_model_lacks_is_refused_naming_it(model, local):
    x, t = _inputs()
    key = "diffusion_model.transformer_blocks.99.attn1.to_q.weight"
    lora = Lora((torch.ones(32, 2), torch.ones(2, 32), None, None, None, None))
    with pytest.raises(BadInputError, match="transformer_blocks.99"):
        model.forward(x, t, _context(local), patches=("bad", {key: [(1.0, lora, 1.0, None, None)]}))
    bad_shape = Lora((torch.ones(8, 2), torch.ones(2, 8), None, None, None, None))
    with pytest.raises(BadInputError, match="another model"):
        model.forward(x, t, _context(local), patches=("bad2", {Q: [(1.0, bad_shape, 1.0, None, None)]}))
    model.forward(x, t, _context(local))  # serving, loaded weights


def test_model_arguments_the_pool_does_not_implement_are_refused_by_name(model, local):
    x, t = _inputs()
    with pytest.raises(BadInputError, match="keyframe_idxs"):
        model.forward(x, t, _context(local), kwargs=["keyframe_idxs"])
    params = {"model": model.name, "context_id": "c", "kwargs": ["ref_audio"]}
    tensors = {"x.0": x[0], "x.1": x[1], "t.0": t[0], "t.1": t[1], "context": _context(local)}
    with pytest.raises(BadInputError, match="ref_audio"):
        model.client().request("forward", params, tensors, timeout=60)


def test_another_model_loaded_under_the_same_name_is_never_run_in_its_place(pool, model, local, base, tiny_ltx_23):
    x, t = _inputs()
    ctx = _context(local)
    before = model.forward(x, t, ctx)
    lora = _lora_file(base / "same-name.safetensors", _factors(7))
    other = _model(pool, tiny_ltx_23, name=model.name, loras=[(lora, 1.0)])  # replaces it in the pool
    theirs = other.forward(x, t, ctx)
    assert _diff(theirs, before) > 1e-3
    assert _diff(model.forward(x, t, ctx), before) == 0.0  # refused (no_model), loaded again, run
    assert _diff(other.forward(x, t, ctx), theirs) == 0.0


def test_a_model_the_pool_freed_is_loaded_again(pool, model, local):
    x, t = _inputs()
    ctx = _context(local)
    before = model.forward(x, t, ctx)
    pool.request("unload", {"names": [model.name]}, timeout=60)
    assert _diff(model.forward(x, t, ctx), before) == 0.0
