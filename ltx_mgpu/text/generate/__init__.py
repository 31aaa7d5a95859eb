"""Gemma 3 as a causal language model in the pool: ComfyUI's ``CLIP.generate`` (``TextGenerate``,
``TextGenerateLTX2Prompt``) on the pool's loaded Gemma.

* :mod:`~ltx_mgpu.text.generate.options`: what one generation asks for (ComfyUI's sampling
  options, stop tokens, prompt padding), checked once;
* :mod:`~ltx_mgpu.text.generate.tokens`: the prompt's token ids and the generated text, exactly
  as ComfyUI's LTX-2 Gemma tokenizer makes and decodes them;
* :mod:`~ltx_mgpu.text.generate.sampling`: ComfyUI's sampler as a transformers logits processor;
* :mod:`~ltx_mgpu.text.generate.causal_lm`: the causal LM over a loaded text tower and
  transformers' ``generate`` on it.
"""
