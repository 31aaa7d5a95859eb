"""The Gemma Loader's ``CLIP`` output (``nodes/_clip.py``) without ComfyUI, through a real 2-rank CPU pool.

* The loader's second output is a :class:`GemmaClip` of its first; ``tokenize`` ->
  ``encode_from_tokens_scheduled`` (what ``CLIPTextEncode`` calls) gives exactly the
  CONDITIONING ``LTXMGPU_PromptEncode`` gives for the same prompt (same structure, keys and
  tensor), in bf16 and in fp32; ``encode_from_tokens`` in its three forms.
* The embedding cache: a second encode of the same prompt never contacts the pool; entries of
  prompts within the 1024-token budget are shared with Prompt Encode both ways.
* A 1,100-token prompt is encoded whole (as ComfyUI does), equal to an in-process encoder with
  room for it, while Prompt Encode cuts it at 1024 tokens; a unicode prompt (umlauts, emoji,
  kanji) encodes as in-process; a prompt over the protocol's 8192 tokens is bad input.
* ``clone`` keeps its own layer, tokenizer options and patch lists (LoRAs: encodes and generations
  with them, tests/integration/test_clip_generate.py); what the CLIP does not support fails with a
  message naming the fix (``embedding:`` syntax, encoding chat-templated tokens, foreign
  tokens, ComfyUI-only attributes).

The same CLIP inside a real ComfyUI, against ComfyUI's own LTX-2 text encoder: test_comfyui_clip.py.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from nodes_support import PACK, NoPool, cpu_pool, node, run

from ltx_mgpu.text.encoder.local import LocalTextEncoder

clip_module = sys.modules[f"{PACK}.nodes._clip"]
GemmaClip = clip_module.GemmaClip
PROMPT = "a red fox walks slowly through the snow at night, camera light"
UNICODE = "Ein Fuchs läuft durch den Schnee 🦊, 雪の中の狐"


@pytest.fixture(scope="module")
def pool(env):
    with cpu_pool() as handle:
        yield handle


@pytest.fixture(scope="module")
def loaded(pool):
    """The Gemma Loader's two outputs, Gemma computing in bf16 (its ``dtype``; the default, ``auto``,
    is fp32 on this CPU pool: the ``fp32`` fixture's)."""
    return run("LTXMGPU_GemmaLoader", pool, "tiny-gemma-comfy.safetensors",
                                            "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True,
                                            dtype="bf16")


@pytest.fixture(scope="module")
def fp32(loaded):
    """The same text encoder computing in fp32, and its CLIP."""
    te = loaded[0]
    te32 = dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32"))
    return te32, GemmaClip(te32)


@pytest.fixture(scope="module")
def reference(fp32):
    """In-process fp32 encoder with room for a 1,100-token prompt (no cut)."""
    config = dataclasses.replace(fp32[0].config, token_budget=4096, truncate=False)
    return LocalTextEncoder(config).build()


@pytest.fixture(scope="module")
def long_prompt(reference):
    words = ("the cat walks in the city at night and the light of the rain is blue " * 200).split()
    n = 1000
    while reference.token_counts([" ".join(words[:n])])[0] < 1100:
        n += 10
    return " ".join(words[:n])


def prompt_encode(te, text, use_cache):
    """Prompt Encode's conditioning of ``text`` alone (positive = negative: encoded once)."""
    with torch.inference_mode():
        return run("LTXMGPU_PromptEncode", te, text, text, use_cache, unique_id="7")[0]


def clip_encode(clip, text):
    """What ComfyUI's CLIPTextEncode does with a CLIP."""
    with torch.inference_mode():
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def assert_same(a, b):
    """Two CONDITIONING, equal in structure, keys, values and tensors."""
    assert len(a) == len(b) == 1 and a[0][1] == b[0][1]
    assert a[0][0].dtype == b[0][0].dtype == torch.float32 and torch.equal(a[0][0], b[0][0])


def without_pool(te):
    return GemmaClip(dataclasses.replace(te, pool=NoPool()))


# --------------------------------------------------------------------------- the node's output, bf16


def test_gemma_loader_second_output_is_a_clip_of_the_first(loaded):
    te, clip = loaded
    outputs = node("LTXMGPU_GemmaLoader").define_schema().outputs
    assert [(o.display_name, o.io_type) for o in outputs] == [("text_encoder", "LTXMGPU_TEXT_ENCODER"),
                                                              ("clip", "CLIP")]
    assert isinstance(clip, GemmaClip) and clip.handle is te


def test_clip_text_encode_equals_prompt_encode_bf16(loaded):
    te, clip = loaded
    ours = clip_encode(clip, PROMPT)
    assert ours[0][1] == {"pooled_output": None, "unprocessed_ltxav_embeds": True}
    assert ours[0][0].shape[0] == 1 and ours[0][0].device.type == "cpu"
    assert_same(ours, prompt_encode(te, PROMPT, False))


# --------------------------------------------------------------------------- fp32: values, cache, long prompts


def test_clip_equals_prompt_encode_and_the_in_process_encoder(fp32, reference):
    te, clip = fp32
    ours = clip_encode(clip, PROMPT)
    assert_same(ours, prompt_encode(te, PROMPT, False))
    ref = reference.encode([PROMPT])[0].tensor
    assert ours[0][0].shape == (1, *ref.shape) and ref.shape[1] == 48  # tiny LTX-2.3: video 32 + audio 16
    torch.testing.assert_close(ours[0][0][0], ref, rtol=1e-5, atol=1e-6)


def test_second_encode_comes_from_the_cache(fp32):
    te, clip = fp32
    first = clip_encode(clip, PROMPT + " again")
    assert_same(clip_encode(without_pool(te), PROMPT + " again"), first)
    with pytest.raises(AssertionError, match="pool was contacted"):  # the check itself: a miss needs the pool
        clip_encode(without_pool(te), PROMPT + " never encoded")


def test_cache_entries_are_shared_with_prompt_encode(fp32):
    te, clip = fp32
    by_node = prompt_encode(te, "shared one", True)
    assert_same(clip_encode(without_pool(te), "shared one"), by_node)
    by_clip = clip_encode(clip, "shared two")
    assert_same(prompt_encode(dataclasses.replace(te, pool=NoPool()), "shared two", True), by_clip)


def test_a_long_prompt_is_encoded_whole(fp32, reference, long_prompt):
    te, clip = fp32
    n = reference.token_counts([long_prompt])[0]
    assert n >= 1100
    ours = clip_encode(clip, long_prompt)
    assert ours[0][0].shape[1] == n  # every token, BOS included: nothing cut at 1024
    torch.testing.assert_close(ours[0][0][0], reference.encode([long_prompt])[0].tensor, rtol=1e-5, atol=1e-6)
    cut = prompt_encode(te, long_prompt, False)[0][0]
    assert cut.shape[1] == 1024  # Prompt Encode keeps its budget
    # LTX-2.3 normalises per token and Gemma is causal: the first 1024 rows are the cut prompt's
    torch.testing.assert_close(ours[0][0][:, :1024], cut, rtol=1e-4, atol=1e-5)
    assert_same(clip_encode(without_pool(te), long_prompt), ours)  # cached whole


def test_unicode_prompt(fp32, reference):
    te, clip = fp32
    ours = clip_encode(clip, UNICODE)
    ref = reference.encode([UNICODE])[0].tensor
    assert ours[0][0].shape[1] == reference.token_counts([UNICODE])[0] == ref.shape[0]
    torch.testing.assert_close(ours[0][0][0], ref, rtol=1e-5, atol=1e-6)
    assert_same(ours, prompt_encode(te, UNICODE, True))


def test_encode_from_tokens_forms(fp32):
    _, clip = fp32
    tokens = clip.tokenize(PROMPT, return_word_ids=True, tokenizer_options={"gemma3_12b_min_length": 512})
    with torch.inference_mode():
        cond = clip.encode_from_tokens(tokens)
        pooled = clip.encode_from_tokens(tokens, return_pooled=True)
        as_dict = clip.encode_from_tokens(tokens, return_dict=True)
        scheduled = clip.encode_from_tokens_scheduled(tokens, add_dict={"frame_rate": 24.0})
        plain = clip.encode(PROMPT)
    assert isinstance(cond, torch.Tensor) and cond.ndim == 3 and torch.equal(plain, cond)
    assert pooled[1] is None and torch.equal(pooled[0], cond)
    assert set(as_dict) == {"cond", "pooled_output", "unprocessed_ltxav_embeds"} and torch.equal(as_dict["cond"], cond)
    assert scheduled[0][1] == {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 24.0}


def test_a_prompt_over_the_protocol_bound_is_refused_and_the_pool_keeps_serving(fp32):
    from ltx_mgpu.client.errors import BadInputError

    _, clip = fp32
    with pytest.raises(BadInputError, match="over the budget of 8192"):
        clip_encode(clip, "the cat " * 5000)
    assert clip_encode(clip, PROMPT)[0][0].shape[1] > 1


# --------------------------------------------------------------------------- LoRA, clone, what is not supported


def test_clone_keeps_its_own_options_and_patches(fp32):
    _, clip = fp32
    key = next(iter(clip.cond_stage_model.state_dict()))
    twin = clip.clone()
    assert twin is not clip and twin.handle is clip.handle
    twin.clip_layer(-2)
    twin.set_tokenizer_option("gemma3_12b_min_length", 256)
    assert clip.layer_idx is None and clip.tokenizer_options == {}
    assert_same(clip_encode(twin, PROMPT), clip_encode(clip, PROMPT))  # as in ComfyUI: no effect on LTX-2
    up, down = torch.zeros(1, 1), torch.zeros(1, 1)
    adapter = type("LoRAAdapter", (), {"name": "lora", "weights": (up, down, None, None, None, None)})()
    assert twin.add_patches({key: adapter}, 0.5) == [key] and clip.patches == {}
    assert twin.clone().patches == twin.patches and twin.clone().patches is not twin.patches
    # what LoraLoader does with the CLIP, LoRA'd encodes: tests/integration/test_clip_generate.py


def test_what_the_clip_does_not_support_is_refused_with_the_fix(fp32):
    _, clip = fp32
    with pytest.raises(ValueError, match="textual-inversion syntax 'embedding:'"):
        clip.tokenize("a fox, embedding:fluffy in snow")
    with pytest.raises(ValueError, match="chat template"):
        clip.encode_from_tokens(clip.tokenize("a fox", skip_template=False))
    with pytest.raises(ValueError, match="tokens it did not make"):
        clip.encode_from_tokens({"gemma3_12b": [[(2, 1.0)]]})
    with pytest.raises(ValueError, match="as a string"):
        clip.tokenize(None)
    assert not hasattr(clip, "patcher") and not hasattr(clip.cond_stage_model, "load_sd")
    with pytest.raises(AttributeError, match="LTXAVTextEncoderLoader"):
        clip.load_model()
    # ComfyUI's own tokenizer leaves these alone too: accepted
    assert clip.tokenize("<start_of_turn>user", skip_template=False) == {clip_module.TOKENS_KEY: "<start_of_turn>user"}
