"""Gemma 3 as a causal LM in one process (``ltx_mgpu.text.generate``): options, ComfyUI's prompt
ids, ComfyUI's sampler, and generation on every kind of loaded tower.

* :class:`GenerateOptions` refuses each bad option by name, with the fix; the ``generate`` and
  ``text_patches`` request schemas refuse bad fields at the wire;
* the prompt ids are ComfyUI 0.20.1's (``CLIP.tokenize`` on the tiny tokenizer, recorded: the
  ``<end_of_turn>`` split that loses the first id, ``<start_of_turn>`` spelled out, the 1024-id
  left padding), with SentencePiece and with the transformers fallback; decoding as ComfyUI's;
* greedy generation equals transformers' own ``generate`` on the same weights (its
  ``Gemma3ForConditionalGeneration`` from the snapshot), on the dynamic and the static cache,
  on a tower whose table is in host memory and on ComfyUI's fp4_mixed file (its dequantized
  weights); stop tokens and ``max_length`` end it as in
  ComfyUI; sampling is seeded and leaves the process's RNG as it was; ``should_stop`` stops it;
* ComfyUI's sampler: penalties over the generated tokens only, top-k / min-p / top-p as
  ``sample_token`` computes them.

The same against ComfyUI itself: tests/comfyui/test_comfyui_generate.py; through a pool:
tests/integration/test_clip_generate.py.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import HostEmbedding
from ltx_mgpu.text.generate.causal_lm import GemmaGenerator, GenerationCancelled
from ltx_mgpu.text.generate.options import GenerateOptions
from ltx_mgpu.text.generate.sampling import ComfySampling
from ltx_mgpu.text.generate.tokens import GenerationTokenizer, sentencepiece_model
from ltx_mgpu.wire import SchemaError, make_request

CHAT = ("<start_of_turn>system\nYou are nice.<end_of_turn>\n<start_of_turn>user\nUser Raw Input Prompt: a cat."
        "<end_of_turn>\n<start_of_turn>model\n")
#: ComfyUI 0.20.1's ids for CHAT on the tiny tokenizer (``clip.tokenize(CHAT, skip_template=False,
#: min_length=1)`` on LTXAVTextEncoderLoader's CLIP), without the 1024 - 85 leading pads: the
#: first id of "<start_of_turn>" is lost, the others are spelled out, <end_of_turn> is 106.
COMFY_CHAT_IDS = [2, 90, 91, 400, 91, 70, 377, 70, 91, 431, 85, 37, 90, 96, 90, 91, 76, 84, 6, 64, 422, 486, 408, 417,
                  76, 21, 106, 6, 35, 90, 91, 400, 91, 70, 377, 70, 91, 431, 85, 37, 474, 424, 6, 60, 90, 424, 5, 57,
                  72, 94, 5, 48, 85, 87, 412, 5, 55, 403, 84, 87, 91, 33, 378, 425, 387, 21, 106, 6, 35, 90, 91, 400,
                  91, 70, 377, 70, 91, 431, 85, 37, 84, 86, 461, 83, 6]


@pytest.fixture(scope="module")
def tower(tiny_gemma_comfy_file):
    return load_gemma_text_tower(tiny_gemma_comfy_file, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tower):
    return GenerationTokenizer(tower, sentencepiece_model(tower))


@pytest.fixture(scope="module")
def hf_model(tiny_gemma_dir):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir), dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int, stop=(106,)) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=list(stop) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# --------------------------------------------------------------------------- options and the wire


@pytest.mark.parametrize("field, value, message", [
    ("max_length", 0, "max_length must be in 1..16384"),
    ("temperature", -0.5, "temperature must be in 0..10000"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_k", -1, "top_k must be in 0..2147483648"),
    ("top_p", 1.5, "top_p must be in 0..1"),
    ("min_p", -0.1, "min_p must be in 0..1"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("seed", -3, "seed must be in 0..18446744073709551615"),
    ("do_sample", "yes", "do_sample must be True or False"),
    ("pad_to", 9000, "pad_to must be in 0..8192"),
])
def test_options_refuse_each_bad_field_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        GenerateOptions(**{"seed": 0, field: value})


def test_sampling_needs_a_seed_and_greedy_does_not():
    with pytest.raises(ValueError, match="needs a seed when sampling"):
        GenerateOptions(do_sample=True)
    assert GenerateOptions(do_sample=False).greedy and GenerateOptions(do_sample=True, temperature=0.0).greedy
    options = GenerateOptions(seed=7, top_k=3, stop_tokens=[106, 1])
    assert options.stop_tokens == (106, 1) and GenerateOptions.from_params(options.to_params()) == options


@pytest.mark.parametrize("params, message", [
    ({"text": "a", "max_length": 0}, "generate.max_length must be in 1..16384"),
    ({"text": "a", "top_p": 2}, "generate.top_p must be in 0..1"),
    ({"text": "a", "seed": 1 << 64}, "generate.seed must be in 0..18446744073709551615"),
    ({"text": "a", "stop_tokens": ["x"]}, r"generate.stop_tokens\[0\] must be int"),
    ({"text": "a", "sampler": "greedy"}, r"unknown field\(s\) \['sampler'\]"),
    ({"max_length": 3}, "missing the required field 'text'"),
])
def test_the_generate_request_is_checked_at_the_wire(params, message):
    with pytest.raises(SchemaError, match=message):
        make_request("generate", "r1", params)


def test_the_text_patches_and_encode_requests_take_a_patch_set():
    make_request("text_patches", "r1", {"patches": "none", "entries": []})
    make_request("encode", "r2", {"prompts": ["a"], "patches": "lora:ab"})
    with pytest.raises(SchemaError, match="missing the required field 'entries'"):
        make_request("text_patches", "r3", {"patches": "none"})


# --------------------------------------------------------------------------- ComfyUI's prompt ids


def test_prompt_ids_are_comfyuis(tokenizer, tower):
    ids = tokenizer.prompt_ids(CHAT, 1024)
    assert len(ids) == 1024 and ids[-len(COMFY_CHAT_IDS):] == COMFY_CHAT_IDS
    assert set(ids[:-len(COMFY_CHAT_IDS)]) == {0}
    # no special token: <bos> then the text, nothing lost; \( loses its backslash
    plain = tokenizer.prompt_ids("a \\(red\\) fox", 0)
    assert plain == [2, *tokenizer.sp.encode("a (red) fox")] and tokenizer.prompt_ids("", 3) == [0, 0, 2]
    # the transformers fallback (special tokens split as text) gives the same ids on this vocabulary
    assert GenerationTokenizer(tower, None).prompt_ids(CHAT, 1024) == ids
    assert tokenizer.kind == "sentencepiece" and GenerationTokenizer(tower, None).kind == "transformers"


def test_decode_drops_comfyuis_special_tokens(tokenizer):
    text = tokenizer.decode([474, 108, 106, 2, 480])
    assert text == tokenizer.decode([474, 108, 480])  # <bos> a control piece: SentencePiece writes nothing
    assert tokenizer.decode([474, 106], False) == tokenizer.decode([474])  # so is <end_of_turn> here
    with pytest.raises(ValueError, match="outside the tokenizer's 512 pieces"):
        tokenizer.decode([600])


# --------------------------------------------------------------------------- generation


def test_greedy_equals_transformers_generate(tower, tokenizer, hf_model):
    ids = tokenizer.prompt_ids(CHAT, 1024)
    ours = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=24, stop_tokens=()))
    assert ours.tokens == hf_greedy(hf_model, ids, 24, stop=()) and len(ours.tokens) == 24 and not ours.stopped
    static = GemmaGenerator(tower, static_cache=True).generate(ids, GenerateOptions(do_sample=False, max_length=24,
                                                                                   stop_tokens=()))
    assert static.tokens == ours.tokens


def test_a_table_in_host_memory_gets_a_head_on_the_layers_device(tiny_gemma_comfy_file, tokenizer, hf_model):
    tower = load_gemma_text_tower(tiny_gemma_comfy_file, dtype=torch.float32)
    tower.model.set_input_embeddings(HostEmbedding(tower.model.get_input_embeddings(), torch.device("cpu")))
    ids = tokenizer.prompt_ids("a red fox", 16)
    ours = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=12, stop_tokens=()))
    assert ours.tokens == hf_greedy(hf_model, ids, 12, stop=())


def test_a_stop_token_ends_the_text_and_is_in_it(tower, tokenizer):
    ids = tokenizer.prompt_ids(CHAT, 1024)
    free = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=10, stop_tokens=()))
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    out = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=10, stop_tokens=(stop,)))
    assert out.tokens == free.tokens[:first + 1] and out.stopped and out.prompt_tokens == 1024


def test_sampling_is_seeded_and_leaves_the_rng_alone(tower, tokenizer):
    ids = tokenizer.prompt_ids(CHAT, 64)
    gen = GemmaGenerator(tower)
    options = GenerateOptions(do_sample=True, seed=5, max_length=20, temperature=0.7, top_k=64, top_p=0.95,
                              min_p=0.05, repetition_penalty=1.05, stop_tokens=())
    state = torch.random.get_rng_state()
    a = gen.generate(ids, options).tokens
    assert torch.equal(torch.random.get_rng_state(), state)
    assert gen.generate(ids, options).tokens == a
    other = gen.generate(ids, GenerateOptions(**{**options.to_params(), "seed": 6, "stop_tokens": ()})).tokens
    assert other != a


def test_should_stop_ends_a_generation(tower, tokenizer):
    seen = []
    with pytest.raises(GenerationCancelled) as info:
        GemmaGenerator(tower).generate(tokenizer.prompt_ids("a fox", 8), GenerateOptions(do_sample=False,
                                                                                          max_length=500),
                                       on_token=seen.append, should_stop=lambda: len(seen) >= 3)
    assert 3 <= len(info.value.tokens) < 500 and seen[:3] == [1, 2, 3]


def test_bad_prompt_ids_are_refused(tower):
    gen = GemmaGenerator(tower)
    with pytest.raises(ValueError, match="outside Gemma's 512-token vocabulary"):
        gen.generate([2, 262144], GenerateOptions(do_sample=False))
    with pytest.raises(ValueError, match="at least one prompt token"):
        gen.generate([], GenerateOptions(do_sample=False))


# --------------------------------------------------------------------------- ComfyUI's sampler


def _warp(scores, generated=(), prompt=2, **options):
    options.setdefault("seed", 0)
    ids = torch.tensor([[9] * prompt + list(generated)])
    return ComfySampling(GenerateOptions(**options), prompt, torch.float32)(ids, torch.tensor([scores]))[0]


def test_penalties_apply_to_generated_tokens_only():
    out = _warp([2.0, -2.0, 2.0, 1.0], generated=(0, 1), repetition_penalty=2.0, presence_penalty=0.5, top_k=0,
                top_p=1.0)
    assert out.tolist() == [2.0 * 0.5 - 0.5, -2.0 * 2.0 - 0.5, 2.0, 1.0]  # token 9 (the prompt's) untouched


def test_top_k_min_p_top_p_as_comfyui_computes_them():
    low = torch.finfo(torch.float32).min
    assert _warp([1.0, 3.0, 2.0, 0.0], top_k=2, top_p=1.0).tolist() == [low, 3.0, 2.0, low]
    # min-p: softmax [e^3, e^2, e^1, e^0] / sum; keep p >= 0.3 * max
    kept = _warp([3.0, 2.0, 1.0, 0.0], top_k=0, min_p=0.3, top_p=1.0)
    assert kept.tolist() == [3.0, 2.0, low, low]
    # top-p (probabilities 0.644, 0.237, 0.087, 0.032): a token whose cumulative probability, its
    # own included, passes top_p is dropped (transformers keeps it); the first one always stays
    assert _warp([3.0, 2.0, 1.0, 0.0], top_k=0, top_p=0.9).tolist() == [3.0, 2.0, low, low]
    assert _warp([3.0, 2.0, 1.0, 0.0], top_k=0, top_p=0.7).tolist() == [3.0, low, low, low]
    assert _warp([3.0, 2.0, 1.0, 0.0], top_k=0, top_p=0.1).tolist() == [3.0, low, low, low]
    assert _warp([1.0, 2.0], top_k=0, top_p=1.0, temperature=0.5).tolist() == [2.0, 4.0]


def test_a_comfyui_quantized_file_generates_what_its_dequantized_weights_do(tiny_gemma_dir, tmp_path, tokenizer):
    """ComfyUI's fp4_mixed Gemma (nvfp4 + fp8 + bf16 layers, dequantized at load as ComfyUI
    computes them): greedy tokens equal transformers' ``generate`` on those same weights."""
    from transformers import Gemma3ForCausalLM

    from ltx_mgpu.assets.gemma import build_tiny_gemma_comfy_file

    path = tmp_path / "tiny-fp4_mixed.safetensors"
    build_tiny_gemma_comfy_file(tiny_gemma_dir, path, "fp4_mixed")
    tower = load_gemma_text_tower(path, dtype=torch.float32)
    hf = Gemma3ForCausalLM(tower.config).eval()
    hf.model.load_state_dict(tower.model.state_dict())
    hf.tie_weights()
    ids = tokenizer.prompt_ids(CHAT, 1024)
    ours = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=20, stop_tokens=()))
    assert ours.tokens == hf_greedy(hf, ids, 20, stop=())
