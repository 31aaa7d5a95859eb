"""ltx_mgpu: the engine of the LTX-2 Multi-GPU node pack.

It runs without ComfyUI: Gemma 3 text encoding for LTX-2 (``ltx_mgpu.text``), the
sidecar torchrun pool (``ltx_mgpu.pool``, ``ltx_mgpu.client.pool_client``) and sequence-parallel
denoising (``ltx_mgpu.denoise``). Nothing in this package imports ComfyUI; see the
README's "Architecture" section for who may import whom.
"""

__version__ = "0.1.0"
