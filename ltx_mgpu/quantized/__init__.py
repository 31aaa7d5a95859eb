"""Quantized weight files, for any model (nothing here knows Gemma or LTX-2): ComfyUI's quantized
single files and GGUF files, which layer is stored how, its dense weight, and layers that keep
the stored bytes.

ComfyUI stores a "mixed" file (e.g. ``gemma_3_12B_it_fp4_mixed.safetensors``) as chosen layers
quantized, each marked, and the rest plain bf16. This package reads such files for any model
(nothing here knows Gemma):

* :mod:`ltx_mgpu.quantized.layers`: the per-layer formats of a file (``<layer>.comfy_quant``
  markers, the older ``_quantization_metadata`` header, fp8 weights without a marker), read from
  the header and the small marker tensors only, with a clear error for a format that cannot be
  read (:class:`~ltx_mgpu.quantized.layers.QuantFormatError`);
* :mod:`ltx_mgpu.quantized.dequant`: a layer's stored tensors -> its dense weight, through
  comfy-kitchen's eager functions (ComfyUI's own kernel library), exactly as ComfyUI
  dequantizes them;
* :mod:`ltx_mgpu.quantized.encode`: the other way, dense weights -> ComfyUI's stored layout
  (comfy-kitchen's quantizers and ComfyUI's marker), to write test and benchmark files;
* :mod:`ltx_mgpu.quantized.ggml`: GGUF files (through ``gguf``, llama.cpp's reader) and the
  dequantization of their GGML block types;
* :mod:`ltx_mgpu.quantized.packed`: linear layers that keep a file's GGML blocks on the device
  (sharded or whole) and dequantize them per call.

comfy-kitchen takes about 2 s to import, so only :mod:`~ltx_mgpu.quantized.dequant` and
:mod:`~ltx_mgpu.quantized.encode` import it, and only when a layer is actually converted.
"""
