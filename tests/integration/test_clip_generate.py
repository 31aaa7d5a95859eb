"""Prompt enhancement and text-encoder LoRAs on the Gemma Loader's CLIP, through a real 2-rank CPU pool.

Generation (``GemmaClip.generate`` / ``decode``, what ComfyUI's ``TextGenerate`` and
``TextGenerateLTX2Prompt`` call; ``ltx_mgpu.pool.generate_jobs``):

* greedy tokens equal transformers' own ``generate`` on the same weights and the in-process
  generator, the text equals the in-process decode; ComfyUI's chat template is applied by
  ``tokenize(skip_template=False)``; sampled tokens equal the in-process sampler's for the seed;
* every placement (``single``, ``batch_parallel``, ``accelerate``) and weights mode (``nf4``, a
  GGUF file) generates what the same tower generates in one process;
* Stop during a generation raises ComfyUI's interrupt and the pool keeps serving; options out of
  range and foreign ids are refused naming the fix (images: tests/integration/test_clip_vision.py).

LoRAs (``LoraLoader``'s CLIP strength: ``add_patches``; ``text_patches`` in the pool):

* ``cond_stage_model.state_dict()`` names the Gemma tower's weights, its vision tower's and
  projector's and the LTX-2.3 text projection's as ComfyUI does, so ``add_patches`` takes exactly those keys;
* a LoRA'd CLIP encodes (and generates) what an in-process encoder with the same patches merged
  does (fp32, every key of a layer patched, ``batch_parallel``: both ranks merged); the plain CLIP
  afterwards encodes what it did before; strengths matter; a LoRA on the text projection (both
  linears, a diff on a bias) encodes what the in-process encoder with it merged does, on both
  ``batch_parallel`` ranks too;
* the embedding cache keeps a LoRA'd CLIP's entries apart from the plain one's;
* a factor that does not fit is refused naming the key, the pool keeps serving; a LyCORIS
  adapter is refused at ``add_patches``.

Against ComfyUI itself: tests/comfyui/test_comfyui_generate.py.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from nodes_support import PACK, NoPool, bridge, cpu_pool, run

from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.denoise.patches import WeightPatch
from ltx_mgpu.text.cache.keys import resolve_dtype
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.local import LocalTextEncoder
from ltx_mgpu.text.encoder.patches import EncoderPatches, comfy_vision_keys
from ltx_mgpu.text.gemma.lora import COMFY_TOWER_PREFIX, TowerPatches
from ltx_mgpu.text.gemma.vision import find_vision
from ltx_mgpu.text.generate.causal_lm import GemmaGenerator
from ltx_mgpu.text.generate.options import GenerateOptions
from ltx_mgpu.text.generate.tokens import GenerationTokenizer, sentencepiece_model

clip_module = sys.modules[f"{PACK}.nodes._clip"]
GemmaClip = clip_module.GemmaClip
PROMPT = "a red fox walks slowly through the snow at night, camera light"
ENHANCE = (f"<start_of_turn>system\nYou expand prompts.<end_of_turn>\n<start_of_turn>user\nUser Raw Input Prompt: "
           f"{PROMPT}.<end_of_turn>\n<start_of_turn>model\n")
GREEDY = {"do_sample": False, "max_length": 24}
SAMPLED = {"do_sample": True, "max_length": 24, "temperature": 0.7, "top_k": 64, "top_p": 0.95, "min_p": 0.05,
           "repetition_penalty": 1.05, "seed": 3, "presence_penalty": 0.0}
LAYER = COMFY_TOWER_PREFIX + "layers.2."


@pytest.fixture(scope="module")
def pool(env):
    with cpu_pool() as handle:
        yield handle


@pytest.fixture(scope="module")
def loaded(pool):
    return run("LTXMGPU_GemmaLoader", pool, "tiny-gemma-comfy.safetensors", "checkpoints/tiny-ltx-2.3.safetensors",
               "bf16", "single", True)


def variant(te, **changes):
    """The Gemma Loader's text encoder with other settings, and its CLIP."""
    te2 = dataclasses.replace(te, config=dataclasses.replace(te.config, **changes))
    return te2, GemmaClip(te2)


@pytest.fixture(scope="module")
def fp32(loaded):
    return variant(loaded[0], dtype="float32")


@pytest.fixture(scope="module")
def local(fp32):
    """The same text encoder in this process (fp32): its tower, generation tokenizer, generator."""
    encoder = LocalTextEncoder(fp32[0].config).build()
    tower = encoder.tower
    tokens = GenerationTokenizer(tower, sentencepiece_model(tower))
    return types.SimpleNamespace(encoder=encoder, tower=tower, tokens=tokens, generator=GemmaGenerator(tower))


def in_process(local, text: str, options: dict) -> list[int]:
    return local.generator.generate(local.tokens.prompt_ids(text, 1024), GenerateOptions(**options)).tokens


def enhance(clip, text=ENHANCE, **options):
    """What TextGenerate does with a CLIP: tokenize, generate, decode."""
    tokens = clip.tokenize(text, image=None, skip_template=False, min_length=1, thinking=False, video=None, audio=None)
    ids = clip.generate(tokens, **options)
    return ids, clip.decode(ids)


# --------------------------------------------------------------------------- generation


def test_greedy_generation_equals_transformers_and_in_process(fp32, local, tiny_gemma_dir):
    from transformers import Gemma3ForConditionalGeneration

    ids, text = enhance(fp32[1], **GREEDY)
    assert ids == in_process(local, ENHANCE, GREEDY) and text == local.tokens.decode(ids)
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir), dtype=torch.float32).eval()
    x = torch.tensor([local.tokens.prompt_ids(ENHANCE, 1024)])
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                      eos_token_id=[106], pad_token_id=0)
    assert ids == out[0, x.shape[1]:].tolist()


def test_tokenize_applies_comfyuis_chat_template(fp32, local):
    clip = fp32[1]
    tokens = clip.tokenize(PROMPT, skip_template=False)
    assert tokens == {clip_module.TOKENS_KEY: clip_module.COMFY_CHAT_TEMPLATE.format(PROMPT),
                      clip_module.TEMPLATE_KEY: True}
    assert clip.tokenize(PROMPT, skip_template=False, llama_template="<{}>")[clip_module.TOKENS_KEY] == f"<{PROMPT}>"
    assert clip.generate(tokens, **GREEDY) == in_process(local, clip_module.COMFY_CHAT_TEMPLATE.format(PROMPT), GREEDY)
    with pytest.raises(ValueError, match="encodes LTX-2 prompts as plain text"):
        clip.encode_from_tokens(tokens)


def test_sampled_generation_is_the_seeds(fp32, local):
    ids, _ = enhance(fp32[1], **SAMPLED)
    assert ids == in_process(local, ENHANCE, SAMPLED)
    assert enhance(fp32[1], **{**SAMPLED, "seed": 4})[0] != ids


@pytest.mark.parametrize("placement", ["batch_parallel", "accelerate"])
def test_every_placement_generates_the_same(fp32, local, placement):
    _, clip = variant(fp32[0], placement=placement)
    assert enhance(clip, **GREEDY)[0] == in_process(local, ENHANCE, GREEDY)


def test_nf4_and_gguf_weights_generate_what_they_compute_in_process(loaded, tiny_gemma_dir, tmp_path):
    from ltx_mgpu.assets.ggml_export import export_gemma_gguf

    gguf = export_gemma_gguf(tiny_gemma_dir, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    for changes, source, weights in (({"weights": "nf4"}, loaded[0].config.gemma, "nf4"),
                                     ({"gemma": str(gguf), "dtype": "float32"}, gguf, "bf16")):
        te, clip = variant(loaded[0], **changes)
        dtype = resolve_dtype(te.config, "cpu").dtype  # what the CPU pool computes in ('auto': ComfyUI's choice)
        tower = load_gemma_text_tower(source, dtype=getattr(torch, dtype), weights=weights)
        tokens = GenerationTokenizer(tower, sentencepiece_model(tower))
        want = GemmaGenerator(tower).generate(tokens.prompt_ids(ENHANCE, 1024), GenerateOptions(**GREEDY)).tokens
        assert enhance(clip, **GREEDY)[0] == want


def test_stop_during_a_generation_interrupts_and_the_pool_keeps_serving(fp32, pool):
    events = []

    def hook(node_id, value, total):  # the generation's ticks (a load of the encoder may tick first)
        if total == 16384:
            events.append((node_id, value, total))
            if len(events) == 2:
                bridge.interrupt_current_processing(True)

    before = enhance(fp32[1], **GREEDY)[0]
    pid = pool.client.pid
    bridge.set_progress_hook(hook)
    try:
        with pytest.raises(bridge.InterruptProcessingException):
            fp32[0].generate(PROMPT, {"do_sample": False, "max_length": 16384, "stop_tokens": []}, node_id="9")
    finally:
        bridge.set_progress_hook(None)
        bridge.interrupt_current_processing(False)
    assert len(events) >= 2 and all(node_id == "9" for node_id, _, _ in events) and events[-1][1] < 16384
    assert pool.client.pid == pid and enhance(fp32[1], **GREEDY)[0] == before


def test_what_generate_cannot_do_is_refused_with_the_fix(fp32):
    clip = fp32[1]
    tokens = clip.tokenize(PROMPT)
    with pytest.raises(ValueError, match="temperature must be in 0..10000"):
        clip.generate(tokens, temperature=-1.0, seed=0)
    with pytest.raises(ValueError, match="needs a seed when sampling"):
        clip.generate(tokens, do_sample=True)
    with pytest.raises(ValueError, match="decodes the token ids its own generate returned"):
        clip.decode([1, 2, 3])
    with pytest.raises(BadInputError, match="over the protocol's 8192"):
        clip.generate(clip.tokenize("the cat " * 5000), **GREEDY)
    assert len(clip.generate(tokens, **GREEDY)) > 0


# --------------------------------------------------------------------------- LoRAs


def adapter(up, down, alpha=None, name="lora"):
    """A stand-in for ComfyUI's LoRAAdapter (``name``, ``weights``): what comfy.lora.load_lora builds."""
    return types.SimpleNamespace(name=name, weights=(up, down, alpha, None, None, None))


def layer_lora(tower, seed=0, rank=2):
    """A LoRA on every weight of decoder layer 2: ComfyUI key -> (up, down)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in tower.model.layers[2].named_parameters():
        if p.ndim == 2:
            out[f"{LAYER}{name}"] = (0.05 * torch.randn(p.shape[0], rank, generator=g),
                                     0.05 * torch.randn(rank, p.shape[1], generator=g))
    return out


def lora_clip(clip, factors, strength=1.0, alpha=4.0):
    patched = clip.clone()
    taken = patched.add_patches({k: adapter(u, d, alpha) for k, (u, d) in factors.items()}, strength)
    assert sorted(taken) == sorted(factors)
    return patched


def clip_encode(clip, text):
    with torch.inference_mode():
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))[0][0][0]


@pytest.fixture(scope="module")
def merged(local, fp32):
    """The in-process encoder with the layer-2 LoRA merged (strength 0.8, alpha 4), and the factors."""
    factors = layer_lora(local.tower)
    patches = {k: [WeightPatch("lora", 0.8, up=u, down=d, alpha=4.0)] for k, (u, d) in factors.items()}
    yield factors, patches
    TowerPatches(local.tower).set({})


def test_the_clip_names_the_gemma_weights_as_comfyui(fp32, local):
    keys = fp32[1].cond_stage_model.state_dict()
    projection = {f"text_embedding_projection.{n}": tuple(p.shape)
                  for n, p in local.encoder.projection.named_parameters()}  # LTX-2.3's two linears
    vision = comfy_vision_keys(find_vision(fp32[0].config.gemma))  # the tiny ComfyUI file has a vision tower
    assert len(projection) == 4 and vision and {k: tuple(v.shape) for k, v in keys.items()} == {
        **{COMFY_TOWER_PREFIX + n: tuple(p.shape) for n, p in local.tower.model.named_parameters()}, **projection,
        **vision}
    assert all(v.device.type == "meta" for v in keys.values())
    twin = fp32[1].clone()
    assert twin.add_patches({"diffusion_model.x.weight": adapter(torch.zeros(1, 1), torch.zeros(1, 1))}) == []
    with pytest.raises(ValueError, match="'loha' adapter .LyCORIS. cannot be merged"):
        twin.add_patches({LAYER + "mlp.up_proj.weight": adapter(torch.zeros(1, 1), torch.zeros(1, 1), name="loha")})


def test_a_lora_clip_encodes_with_the_lora_merged(fp32, local, merged):
    factors, patches = merged
    plain = clip_encode(fp32[1], PROMPT)
    ours = clip_encode(lora_clip(fp32[1], factors, 0.8), PROMPT)
    merger = TowerPatches(local.tower)
    merger.set(patches)
    try:
        want = local.encoder.encode([PROMPT])[0].tensor
    finally:
        merger.set({})
    assert (ours - plain).abs().max() > 1e-3 * plain.abs().max()  # the LoRA changes the embedding
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(clip_encode(fp32[1], PROMPT + " again"), clip_encode(fp32[1], PROMPT + " again"))
    torch.testing.assert_close(clip_encode(fp32[1], PROMPT + " later"),
                               local.encoder.encode([PROMPT + " later"])[0].tensor, rtol=1e-5, atol=1e-6)
    half = clip_encode(lora_clip(fp32[1], factors, 0.4), PROMPT)
    assert not torch.equal(half, ours) and not torch.equal(half, plain)


def test_the_cache_keeps_lora_entries_apart(fp32, merged):
    factors, _ = merged
    text = PROMPT + " cached"
    lora = clip_encode(lora_clip(fp32[1], factors, 0.8), text)
    plain = clip_encode(fp32[1], text)
    assert not torch.equal(lora, plain)
    offline = dataclasses.replace(fp32[0], pool=NoPool())  # any pool use fails: both come from the cache
    assert torch.equal(clip_encode(lora_clip(GemmaClip(offline), factors, 0.8), text), lora)
    assert torch.equal(clip_encode(GemmaClip(offline), text), plain)


def test_a_lora_clip_generates_with_the_lora_merged(fp32, local, merged):
    factors, patches = merged
    ids, _ = enhance(lora_clip(fp32[1], factors, 0.8), **GREEDY)
    merger = TowerPatches(local.tower)
    merger.set(patches)
    local.generator.reset()
    try:
        want = in_process(local, ENHANCE, GREEDY)
    finally:
        merger.set({})
        local.generator.reset()
    assert ids == want and ids != enhance(fp32[1], **GREEDY)[0]


def test_both_batch_parallel_ranks_merge_the_lora(fp32, local, merged):
    factors, patches = merged
    w = local.encoder.projection.audio_aggregate_embed.weight
    g = torch.Generator().manual_seed(12)
    key = "text_embedding_projection.audio_aggregate_embed.weight"
    factors = {**factors, key: (0.05 * torch.randn(w.shape[0], 2, generator=g),
                                0.05 * torch.randn(2, w.shape[1], generator=g))}
    patches = {**patches, key: [WeightPatch("lora", 0.8, up=factors[key][0], down=factors[key][1], alpha=4.0)]}
    te, clip = variant(fp32[0], placement="batch_parallel")
    prompts = [PROMPT + " one", PROMPT + " two", PROMPT + " three"]
    got, _, _ = te.encode(prompts, use_cache=False, patches=lora_clip(clip, factors, 0.8)._text_patches())
    merger = EncoderPatches(local.tower, local.encoder.projection)
    merger.set(patches)
    try:
        want = local.encoder.encode(prompts)
    finally:
        merger.set({})
    for g, w in zip(got, want):
        torch.testing.assert_close(g.tensor, w.tensor, rtol=1e-5, atol=1e-6)


def test_a_lora_on_the_text_projection_is_merged_into_the_pools(fp32, local, merged):
    factors, patches = merged
    g = torch.Generator().manual_seed(11)
    proj = local.encoder.projection
    bias = torch.randn(proj.video_aggregate_embed.bias.shape, generator=g)
    for side in ("video", "audio"):
        w = getattr(proj, f"{side}_aggregate_embed").weight
        factors = {**factors, f"text_embedding_projection.{side}_aggregate_embed.weight": (
            0.05 * torch.randn(w.shape[0], 2, generator=g), 0.05 * torch.randn(2, w.shape[1], generator=g))}
    clip = lora_clip(fp32[1], factors, 0.8)
    assert clip.add_patches({"text_embedding_projection.video_aggregate_embed.bias": ("diff", (bias,))}, 0.5) == [
        "text_embedding_projection.video_aggregate_embed.bias"]
    ours = clip_encode(clip, PROMPT)
    want_patches = {k: [WeightPatch("lora", 0.8, up=u, down=d, alpha=4.0)] for k, (u, d) in factors.items()}
    want_patches["text_embedding_projection.video_aggregate_embed.bias"] = [WeightPatch("diff", 0.5, diff=bias)]
    merger = EncoderPatches(local.tower, proj)
    merger.set(want_patches)
    try:
        want = local.encoder.encode([PROMPT])[0].tensor
    finally:
        merger.set({})
    tower_only = clip_encode(lora_clip(fp32[1], merged[0], 0.8), PROMPT)
    assert (ours - tower_only).abs().max() > 1e-3 * tower_only.abs().max()  # the projection's LoRA counts
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clip_encode(fp32[1], PROMPT + " after"),
                               local.encoder.encode([PROMPT + " after"])[0].tensor, rtol=1e-5, atol=1e-6)


def test_a_lora_that_does_not_fit_is_refused_by_key_and_the_pool_keeps_serving(fp32):
    key = LAYER + "mlp.up_proj.weight"
    bad = fp32[1].clone()
    bad.add_patches({key: adapter(torch.ones(3, 1), torch.ones(1, 5))})
    with pytest.raises(BadInputError, match="mlp.up_proj.weight: LoRA factors"):
        clip_encode(bad, PROMPT + " bad")
    assert clip_encode(fp32[1], PROMPT).shape[1] == 48
