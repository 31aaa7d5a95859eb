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
  never run in its place;
* what ComfyUI's model-patching nodes need of the pool: blocks skipped for one call (skip-layer
  guidance) and scale-only weight patches (the attention multipliers), also on the connectors'
  weights, which the text contexts are processed with.

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
from ltx_mgpu.denoise.comfyui.forward import av_timestep_convention, comfy_forward, processed_context
from ltx_mgpu.denoise.comfyui.skip_blocks import skipped_blocks
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike

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
    plan = TransformerPlan(str(checkpoint), dtype="fp32", loras=list(loras))

    def load():
        return remote_load_transformer(pool, plan, name=name, timeout=120)

    loaded = load()
    return PoolModel(lambda: pool, load, name=name, av_timestep=av, key=loaded["key"])


@pytest.fixture(scope="module")
def model(pool, tiny_ltx_23):
    return _model(pool, tiny_ltx_23)


@pytest.fixture(scope="module")
def local(tiny_ltx_23):
    return load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))


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
    conds = {"denoise_mask": torch.ones(2, 128, 3, 3, 5)} if case == "av_per_token" else {}
    got = pm.forward(x, t, ctx, frame_rate=24.0, conds=conds)
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


# --------------------------------------------------------------------------- model-patching nodes


def test_skipped_blocks_on_two_ranks_equal_the_call_in_process(model, local):
    """ComfyUI's skip-layer guidance: the named blocks pass their inputs through, on every rank."""
    x, t = _inputs()
    ctx = _context(local)
    with skipped_blocks(local.transformer, [1]):
        want = _reference(local, x, t, ctx)
    got = model.forward(x, t, ctx, skip_blocks=[1])
    assert _diff(got, want) <= TOL
    assert _diff(got, model.forward(x, t, ctx)) > 1e-3
    with pytest.raises(BadInputError, match=r"blocks \[5\] to skip are not among this model's 2"):
        model.forward(x, t, ctx, skip_blocks=[5])
    assert model.sent["forward"] >= 3  # serving


def test_scale_patches_of_block_and_connector_weights_equal_the_scaled_weights_in_process(model, local):
    """The attention multipliers' ``(None,)`` patches scale weights in the pool; one on a connector
    weight changes the processed text context, as in ComfyUI's model (the context is processed
    with the call's patches merged)."""
    block, conn = Q, "diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight"
    patches = ("scaled", {block: [(0.0, (None,), 1.3, None, None)], conn: [(0.0, (None,), 0.7, None, None)]})
    text = _text(3, tokens=11)
    x, t = _inputs(batch=1)
    weights = [local.transformer.transformer_blocks[0].attn1.to_q.weight,
               local.video_connector.transformer_1d_blocks[0].attn1.to_q.weight]
    with torch.no_grad():
        plain_ctx = processed_context(local, text, True)
        for w, s in zip(weights, (1.3, 0.7)):
            w.mul_(s)
        try:
            want_ctx = processed_context(local, text, True)
            want = _reference(local, x, t, want_ctx)
        finally:
            for w, s in zip(weights, (1.3, 0.7)):
                w.div_(s)
    got_ctx = model.text_contexts(text, True, patches=patches)
    assert _diff(got_ctx, want_ctx) <= TOL and _diff(got_ctx, plain_ctx) > 1e-4
    assert _diff(model.forward(x, t, got_ctx, patches=patches), want) <= TOL
    assert _diff(model.text_contexts(text, True), plain_ctx) <= TOL  # the loader's MODEL again: no patches
    with pytest.raises(PatchFormatError, match="without a tensor at strength 0.5"):
        model.forward(x, t, got_ctx, patches=("bad", {block: [(0.5, (None,), 1.0, None, None)]}))


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
    with pytest.raises(BadInputError, match="guiding_frame_index"):
        model.forward(x, t, _context(local), conds={"guiding_frame_index": torch.ones(1)})
    params = {"model": model.name, "context_id": "c", "kwargs": ["ref_audio_v2"]}
    tensors = {"x.0": x[0], "x.1": x[1], "t.0": t[0], "t.1": t[1], "context": _context(local)}
    with pytest.raises(BadInputError, match="ref_audio_v2"):
        model.client().request("forward", params, tensors, timeout=60)
    entry = {"pre_filter_count": 15, "strength": 0.5, "latent_shape": [1, 3, 5], "pixel_mask": None, "gamma": 2}
    with pytest.raises(BadInputError, match="gamma"):
        model.forward(x, t, _context(local), conds={"guide_attention_entries": [entry]})


# --------------------------------------------------------------------------- guides, reference audio


def _guided(batch=2, seed=5, strengths=(0.7, 1.0), drop=True):
    """A 2-frame latent + two 1-frame guides appended (3 x 5 tokens each: 60 tokens in all), as
    LTXVAddGuide leaves it: keyframe pixel coordinates, entries, the noise mask (guide frames at
    1 - strength; with ``drop`` the second guide's first row negative: those tokens leave the
    call), per-token timesteps mask x sigma."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, 128, 4, 3, 5, generator=g)
    audio = torch.randn(batch, 8, 7, 16, generator=g)
    mask = torch.ones(batch, 1, 4, 3, 5)
    kf = []
    for i, (frame, s) in enumerate(zip((0, 16), strengths)):
        mask[:, :, 2 + i] = 1.0 - s
        t_ = torch.full((1, 3, 5), float(frame))
        hh, ww = torch.meshgrid(torch.arange(3) * 32.0, torch.arange(5) * 32.0, indexing="ij")
        start = torch.stack([t_[0], hh, ww]).reshape(3, -1)
        end = start + torch.tensor([1.0, 32.0, 32.0]).view(3, 1)
        kf.append(torch.stack([start, end], dim=-1))
    if drop:
        mask[:, :, 3, 0] = -1.0
    keyframe_idxs = torch.cat(kf, dim=1).unsqueeze(0).expand(batch, -1, -1, -1).contiguous()
    entries = [{"pre_filter_count": 15, "strength": s, "latent_shape": [1, 3, 5], "pixel_mask": None}
               for s in strengths]
    sigma = 0.6
    v_t = (mask * sigma).permute(0, 2, 3, 4, 1).reshape(batch, -1, 1)
    t = (v_t, torch.full((batch,), sigma))
    conds = {"denoise_mask": mask.expand(-1, 128, -1, -1, -1), "keyframe_idxs": keyframe_idxs,
             "guide_attention_entries": entries}
    return [video, audio], t, conds


def _local_conds(conds: dict):
    from ltx_mgpu.denoise.comfyui.extra_conds import extra_conds, grid_mask

    mask = conds.get("denoise_mask")
    keep = grid_mask(mask) if mask is not None and conds.get("keyframe_idxs") is not None else None
    return extra_conds(keyframe_idxs=conds.get("keyframe_idxs"), keep=keep,
                       guide_attention_entries=conds.get("guide_attention_entries"),
                       ref_audio=conds.get("ref_audio"), attention_mask=conds.get("attention_mask"))


@pytest.mark.parametrize("case", ["two_guides", "guide_strength_1", "dropped_tokens", "ref_audio", "text_mask",
                                  "all"])
def test_guides_reference_audio_and_text_masks_on_two_ranks_equal_the_call_in_process(model, local, case):
    x, t, conds = _guided(strengths=(1.0, 1.0) if case == "guide_strength_1" else (0.7, 1.0),
                          drop=case in ("dropped_tokens", "all"))
    if case in ("ref_audio", "text_mask"):
        conds = {}
    ctx = _context(local)
    if case in ("ref_audio", "all"):
        conds["ref_audio"] = {"tokens": torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(3))}
    if case in ("text_mask", "all"):
        text_mask = torch.ones(2, ctx.shape[1], dtype=torch.long)
        text_mask[1, -300:] = 0
        conds["attention_mask"] = text_mask
    want = _reference(local, x, t, ctx, frame_rate=24.0, conds=_local_conds(conds))
    got = model.forward(x, t, ctx, frame_rate=24.0, conds=conds)
    assert _diff(got, want) <= TOL
    # without guides no token leaves the call: the dropped tokens' negative timesteps (mask -1 x
    # sigma, which only the grid mask makes harmless) are 0 there
    plain = _reference(local, x, (t[0].clamp(min=0), t[1]), ctx, frame_rate=24.0)
    assert _diff(got, plain) > 1e-3  # each condition changes the result
    if case in ("dropped_tokens", "all"):  # tokens the grid mask drops get a zero velocity (ComfyUI's)
        assert bool((got[0][:, :, 3, 0] == 0).all()) and bool((got[0][:, :, 3, 1:] != 0).any())


def test_guide_inputs_that_do_not_fit_are_refused_naming_them(model, local):
    x, t, conds = _guided()
    ctx = _context(local)
    bad = dict(conds, guide_attention_entries=[dict(conds["guide_attention_entries"][0], pre_filter_count=14,
                                                    latent_shape=[1, 2, 7]), conds["guide_attention_entries"][1]])
    with pytest.raises(BadInputError, match="pre_filter_counts sum to 29"):
        model.forward(x, t, ctx, conds=bad)
    with pytest.raises(BadInputError, match="denoise mask"):
        model.forward(x, t, ctx, conds={k: v for k, v in conds.items() if k != "denoise_mask"})
    with pytest.raises(BadInputError, match="reference audio tokens"):
        model.forward(x, t, ctx, conds={"ref_audio": {"tokens": torch.randn(1, 5, 64)}})
    with pytest.raises(BadInputError, match="needs an audio-video latent"):
        model.forward(x[0], t, ctx, conds={"ref_audio": {"tokens": torch.randn(1, 5, 128)}})
    model.forward(x, t, ctx, conds=conds)  # serving


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


def test_compile_on_runs_compiled_blocks_on_two_ranks_equal_to_the_call_in_process(pool, model, local, tiny_ltx_23):
    """The Model Loader's ``compile: on`` in fp32 (a CPU pool): the pool compiles the blocks
    (``torch.compile``, as dtype fp8 does), says so in its load result, and a call equals the
    eager call in process within float32 rounding; ComfyUI's LoRA patches (merged into the
    weights the compiled graphs read), skip-layer guidance (a skipped block's forward replaced)
    and the patches' removal act on the compiled blocks as on eager ones. A resident model loaded
    with ``auto`` is loaded again, not reused, when ``compile`` changes, and back."""
    eager = TransformerPlan(str(tiny_ltx_23), dtype="fp32")
    first = remote_load_transformer(pool, eager, name="compiled", timeout=120)
    assert first["plan"]["compiled"] is False
    plan = dataclasses.replace(eager, compile="on")
    loaded = remote_load_transformer(pool, plan, name="compiled", timeout=600)
    assert not loaded["reused"] and loaded["key"] != first["key"]
    assert loaded["plan"]["compile"] == "on" and loaded["plan"]["compiled"] is True, loaded["plan"]
    assert remote_load_transformer(pool, plan, name="compiled", timeout=600)["reused"]
    pm = PoolModel(lambda: pool, lambda: remote_load_transformer(pool, plan, name="compiled", timeout=600),
                   name="compiled", key=loaded["key"])
    x, t = _inputs()
    ctx = _context(local)
    want = _reference(local, x, t, ctx)
    for _ in range(2):  # the first call compiles; the second runs the compiled graph
        plain = pm.forward(x, t, ctx)
        assert _diff(plain, want) <= TOL
    patches = ("lora-c", _patches((_factors(7), _adapters(_factors(7)), 0.8)))
    patched = pm.forward(x, t, ctx, patches=patches)
    assert _diff(patched, model.forward(x, t, ctx, patches=patches)) <= TOL  # the eager pool model, same patches
    assert _diff(patched, plain) > 1e-3
    with skipped_blocks(local.transformer, [1]):
        skipped = _reference(local, x, t, ctx)
    assert _diff(pm.forward(x, t, ctx, skip_blocks=[1]), skipped) <= TOL
    assert _diff(pm.forward(x, t, ctx), plain) == 0.0  # patches removed, block 1 back
    model.forward(x, t, ctx)
    again = remote_load_transformer(pool, eager, name="compiled", timeout=120)
    assert not again["reused"] and again["plan"]["compiled"] is False
    pool.request("unload", {"names": ["compiled"]})
