"""The LTX-2 transformer over several ranks: Ulysses sequence parallelism and its call layouts
(:mod:`~ltx_mgpu.denoise.parallel.ulysses`), what is split across the ranks and what that asks of
a model and a call (:mod:`~ltx_mgpu.denoise.parallel.split`), and weights sharded with FSDP2
(:mod:`~ltx_mgpu.denoise.parallel.fsdp`). Nothing here knows ComfyUI or the checkpoint files."""
