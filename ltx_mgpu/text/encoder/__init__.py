"""Running Gemma 3 for LTX-2 prompts: loading the text tower from any source format
(:mod:`~ltx_mgpu.text.encoder.loading`), encoding prompts with it (:mod:`~ltx_mgpu.text.encoder.prompt`),
in this process through the cache (:mod:`~ltx_mgpu.text.encoder.local`) or in the pool's
placements (:mod:`~ltx_mgpu.text.encoder.placement`, with its Accelerate
:mod:`~ltx_mgpu.text.encoder.device_map`). It sits above the model (``text.gemma``, ``text.nf4``),
the cache (``text.cache``) and the LTX-2 types (``text.config``, ``text.features``)."""
