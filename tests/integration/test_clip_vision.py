"""Prompt enhancement with an image on the Gemma Loader's CLIP, through a real 2-rank CPU pool
(``TextGenerate`` / ``TextGenerateLTX2Prompt`` with an image connected; the tiny Gemma in ComfyUI's
single-file format, which carries a one-layer SigLIP vision tower and the projector).

* greedy tokens with an image (one, and a batch of two) equal transformers' own
  ``Gemma3ForConditionalGeneration.generate`` on the same weights, given the same pixels (ComfyUI's
  preprocessing, ``ltx_mgpu.text.generate.image``) and ComfyUI's prompt: the image's soft tokens in
  place of the one ``<image_soft_token>`` (so the reference's prompt holds ``mm_tokens_per_image``
  image ids per image there), causal attention, SigLIP's LayerNorm epsilon ComfyUI's 1e-5 and the
  projector's norm the text tower's epsilon; another image gives another text;
* the Hugging Face snapshot (its ``vision_tower.*`` keys and ``config.json``) reads the image as
  the ComfyUI file does;
* ``tokenize(skip_template=False)`` with an image applies ComfyUI's image chat template;
* a LoRA on the vision tower (``LoraLoader``'s CLIP strength on a SigLIP weight and a LayerNorm)
  generates what transformers' model with ComfyUI's merge of it generates, whether the set came
  before the image loaded the vision tower or after; the plain CLIP then gets the loaded weights;
* a Gemma file without a vision tower refuses an image at ``tokenize`` (and the pool refuses one
  sent past it) naming the fix; a prompt without ``<image_soft_token>`` ignores the image, as
  ComfyUI's tokenizer does (so the pool neither loads nor needs the vision tower for it); an
  image that is not a finite ComfyUI IMAGE is refused before any request; tokens with an image do
  not encode;
* a raw request past the client's resize (an image larger than ComfyUI's tokenizer leaves one, a
  strip whose resize would take gigabytes) is refused by every rank before any work, naming the
  fix, and the pool keeps serving.

The preprocessing and the whole path against ComfyUI itself: tests/comfyui/test_comfyui_generate.py.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from nodes_support import PACK, cpu_pool, run
from safetensors.torch import load_file, save_file

from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.text.gemma.vision import COMFY_LAYER_NORM_EPS
from ltx_mgpu.text.generate.image import tokenizer_image, vision_pixels
from ltx_mgpu.text.generate.tokens import IMAGE_SOFT_TOKEN, GenerationTokenizer, sentencepiece_model

clip_module = sys.modules[f"{PACK}.nodes._clip"]
PROMPT = "a red fox walks slowly through the snow at night, camera light"
ENHANCE = (f"<start_of_turn>system\nYou expand prompts.<end_of_turn>\n<start_of_turn>user\n\n<image_soft_token>\n\n"
           f"User Raw Input Prompt: {PROMPT}.<end_of_turn>\n<start_of_turn>model\n")
GREEDY = {"do_sample": False, "max_length": 24}
#: The tiny Gemma's image token id and soft tokens per image (ltx_mgpu.assets.gemma).
TINY_IMAGE_ID, TINY_TOKENS_PER_IMAGE = 511, 4


def _image(seed: int, batch: int = 1, h: int = 37, w: int = 53) -> torch.Tensor:
    return torch.rand(batch, h, w, 3, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pool(env):
    with cpu_pool() as handle:
        yield handle


@pytest.fixture(scope="module")
def clip(pool):
    """The Gemma Loader's CLIP on the tiny ComfyUI file, computing in fp32."""
    te, loaded = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma-comfy.safetensors",
                     "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True)
    return type(loaded)(dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32")))


@pytest.fixture(scope="module")
def reference(tiny_gemma_dir, tiny_gemma_comfy_file):
    """transformers' Gemma 3 with ComfyUI's vision epsilons, and the prompt's tokenizer."""
    from transformers import Gemma3ForConditionalGeneration

    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower

    hf = Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir), dtype=torch.float32).eval()
    for module in hf.model.vision_tower.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = COMFY_LAYER_NORM_EPS
    hf.model.multi_modal_projector.mm_soft_emb_norm.eps = hf.config.text_config.rms_norm_eps
    tower = load_gemma_text_tower(tiny_gemma_comfy_file, dtype=torch.float32)
    return hf, GenerationTokenizer(tower, sentencepiece_model(tower))


def transformers_ids(reference, text: str, image: torch.Tensor | None, max_length: int = 24) -> list[int]:
    """Greedy ``Gemma3ForConditionalGeneration.generate`` on ComfyUI's prompt ids (module doc)."""
    hf, tokens = reference
    ids = tokens.prompt_ids(text, 1024)
    pixels = None
    if image is not None:
        at = ids.index(IMAGE_SOFT_TOKEN)
        ids = ids[:at] + [TINY_IMAGE_ID] * (TINY_TOKENS_PER_IMAGE * image.shape[0]) + ids[at + 1:]
        pixels = vision_pixels(tokenizer_image(image), hf.config.vision_config.image_size)
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels, do_sample=False,
                          max_new_tokens=max_length, eos_token_id=[106], pad_token_id=0)
    return out[0, x.shape[1]:].tolist()


def enhance(clip, image, text=ENHANCE, **options):
    """What TextGenerate does with a CLIP and an image: tokenize, generate, decode."""
    tokens = clip.tokenize(text, image=image, skip_template=False, min_length=1, thinking=False, video=None,
                           audio=None)
    ids = clip.generate(tokens, **options)
    return ids, clip.decode(ids)


def test_greedy_generation_with_an_image_equals_transformers(clip, reference):
    image = _image(0)
    ids, text = enhance(clip, image, **GREEDY)
    assert ids == transformers_ids(reference, ENHANCE, image)
    assert text == reference[1].decode(ids)
    assert ids != enhance(clip, _image(1), **GREEDY)[0]  # the image's content is read


def test_the_snapshot_reads_the_image_as_the_comfy_file(pool, clip):
    te, loaded = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma", "checkpoints/tiny-ltx-2.3.safetensors", "bf16",
                     "single", True)
    snapshot = type(loaded)(dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32")))
    assert enhance(snapshot, _image(4), **GREEDY) == enhance(clip, _image(4), **GREEDY)


def test_status_counts_the_vision_tower_once_an_image_loads_it(pool, reference):
    """The text encoder's ``status`` bytes on rank 0 grow by the vision tower's (SigLIP and the
    projector, float32: transformers' modules, so the reference's count) when the first image
    loads it; rank 1 holds no vision tower."""
    te, loaded = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma", "checkpoints/tiny-ltx-2.3.safetensors", "bf16",
                     "single", True)
    clip = type(loaded)(dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32")))

    def held():
        return [r["models"]["text_encoder"]["bytes"] for r in pool.client.status()["ranks"]]

    enhance(clip, None, text=PROMPT, **GREEDY)  # loads this encoder; no image: no vision tower
    before = held()
    enhance(clip, _image(5), **GREEDY)
    hf = reference[0].model
    vision = [*hf.vision_tower.parameters(), *hf.vision_tower.buffers(), *hf.multi_modal_projector.parameters(),
              *hf.multi_modal_projector.buffers()]
    assert held() == [before[0] + sum(t.numel() * t.element_size() for t in vision), before[1]]


VISION_Q = "gemma3_12b.transformer.vision_model.encoder.layers.0.self_attn.q_proj.weight"
VISION_NORM = "gemma3_12b.transformer.vision_model.post_layernorm.weight"


def vision_lora(hf):
    """A LoRA on SigLIP's layer-0 query and a diff on its last LayerNorm: ComfyUI key -> (adapter,
    what it merges into transformers' weight: ComfyUI's float32 merge at strength 0.8, rounded to
    the file's bf16)."""
    g = torch.Generator().manual_seed(13)
    q = hf.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight
    norm = hf.model.vision_tower.post_layernorm.weight
    up, down, diff = torch.randn(q.shape[0], 2, generator=g), torch.randn(2, q.shape[1], generator=g), \
        torch.randn(norm.shape, generator=g)
    lora = types.SimpleNamespace(name="lora", weights=(up, down, 4.0, None, None, None))
    return {VISION_Q: (lora, (q.to(torch.bfloat16).float() + 0.8 * 2.0 * up @ down).to(torch.bfloat16).float()),
            VISION_NORM: (("diff", (diff,)), (norm.to(torch.bfloat16).float() + 0.8 * diff).to(torch.bfloat16).float())}


def test_a_lora_on_the_vision_tower_is_merged_when_it_loads_and_when_the_set_changes(pool, clip, reference):
    hf = reference[0]
    patches = vision_lora(hf)
    lora = clip.clone()
    assert sorted(lora.add_patches({k: a for k, (a, _) in patches.items()}, 0.8)) == sorted(patches)
    params = {VISION_Q: hf.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight,
              VISION_NORM: hf.model.vision_tower.post_layernorm.weight}
    loaded = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(patches[k][1])
    try:
        want_lora = transformers_ids(reference, ENHANCE, _image(6))
    finally:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(loaded[k])
    want_plain = transformers_ids(reference, ENHANCE, _image(6))
    assert want_lora != want_plain  # the LoRA changes what the model reads
    te, loaded_snapshot = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma", "checkpoints/tiny-ltx-2.3.safetensors", "bf16",
                              "single", True)
    other = type(loaded_snapshot)(dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32")))
    # a patch set merged before the vision tower loads: it takes the set when the image loads it
    enhance(other, None, text=PROMPT, **GREEDY)  # another encoder resident: this one loads afresh
    assert enhance(lora, _image(6), **GREEDY)[0] == want_lora
    assert enhance(clip, _image(6), **GREEDY)[0] == want_plain  # the loaded weights back
    assert enhance(lora, _image(6), **GREEDY)[0] == want_lora  # merged again into the loaded tower
    # the vision tower loaded before any patch set: the first set reaches it
    enhance(other, None, text=PROMPT, **GREEDY)
    assert enhance(clip, _image(6), **GREEDY)[0] == want_plain
    assert enhance(lora, _image(6), **GREEDY)[0] == want_lora


def test_a_batch_of_images_is_one_image_entry_as_comfyuis(clip, reference):
    images = torch.cat([_image(1, h=64, w=40), _image(2, h=64, w=40)])
    ids, _ = enhance(clip, images, **GREEDY)
    assert ids == transformers_ids(reference, ENHANCE, images)
    assert ids != enhance(clip, images[:1], **GREEDY)[0]


def test_tokenize_with_an_image_applies_comfyuis_image_template(clip, reference):
    image = _image(3)
    tokens = clip.tokenize(PROMPT, image=image, skip_template=False)
    assert tokens[clip_module.TOKENS_KEY] == clip_module.COMFY_CHAT_TEMPLATE_IMAGES.format(PROMPT)
    assert tokens[clip_module.IMAGE_KEY] is image
    assert clip.generate(tokens, **GREEDY) == transformers_ids(
        reference, clip_module.COMFY_CHAT_TEMPLATE_IMAGES.format(PROMPT), image)
    with pytest.raises(ValueError, match="encodes LTX-2 prompts as plain text.*an image"):
        clip.encode_from_tokens(clip.tokenize(PROMPT, image=image))


def test_an_image_without_a_vision_tower_or_a_bad_image_is_refused_with_the_fix(pool, clip, env,
                                                                                tiny_gemma_comfy_file):
    tensors = {k: v for k, v in load_file(str(tiny_gemma_comfy_file)).items()
               if not k.startswith(("vision_model.", "multi_modal_projector."))}
    save_file(tensors, str(env / "text_encoders" / "text-only-gemma.safetensors"),
              metadata={"format": "pt", **{k: v for k, v in _metadata(tiny_gemma_comfy_file).items()
                                           if k == "ltx_mgpu_gemma_config"}})
    te, text_only = run("LTXMGPU_GemmaLoader", pool, "text-only-gemma.safetensors",
                        "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True)
    with pytest.raises(ValueError, match="has no vision tower.*gemma_3_12B_it_fp4_mixed.*disconnect the image"):
        text_only.tokenize(ENHANCE, image=_image(0))
    # a raw request past the CLIP: the pool refuses it, naming the fix, and keeps serving
    with pytest.raises(BadInputError, match="has no vision tower.*gemma_3_12B_it_fp4_mixed"):
        te.generate(ENHANCE, GREEDY, image=_image(0))
    assert len(text_only.generate(text_only.tokenize(PROMPT), **GREEDY)) > 0
    # a prompt without <image_soft_token> ignores the image, as ComfyUI's tokenizer does: no vision tower needed
    assert te.generate(PROMPT, GREEDY, image=_image(0))["tokens"] == te.generate(PROMPT, GREEDY)["tokens"]
    tokens = clip.tokenize(ENHANCE, image=torch.full((1, 8, 8, 3), float("nan")))
    with pytest.raises(ValueError, match="NaN or infinite"):
        clip.generate(tokens, **GREEDY)
    with pytest.raises(ValueError, match="RGB images"):
        clip.generate(clip.tokenize(ENHANCE, image=torch.zeros(1, 8, 8, 1)), **GREEDY)


def test_a_raw_image_past_the_clients_resize_is_refused_by_the_pool(pool, clip, monkeypatch):
    import ltx_mgpu.client.text as client_text

    te = clip.handle
    monkeypatch.setattr(client_text, "tokenizer_image", lambda image: image.float().contiguous())  # a raw client
    with pytest.raises(BadInputError, match="1200 x 1000 pixels of 3 channels, more than ComfyUI's.*tokenizer_image"):
        te.generate(ENHANCE, GREEDY, image=torch.rand(1, 1000, 1200, 3))
    with pytest.raises(BadInputError, match="more than 16 to 1.*crop it"):
        te.generate(ENHANCE, GREEDY, image=torch.rand(1, 2, 600, 3))
    monkeypatch.undo()
    assert enhance(clip, _image(0), **GREEDY)[0] == enhance(clip, _image(0), **GREEDY)[0]  # still serving


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})
