"""Attention backends of our own for ltx-core's LTX-2 transformer: the 8-bit Triton flash
attention (:mod:`~ltx_mgpu.denoise.attention.kernel`) and its ltx-core attention function
(:mod:`~ltx_mgpu.denoise.attention.function`, ``attention_type`` ``triton_8bit``)."""
