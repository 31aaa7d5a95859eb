"""ComfyUI's side of denoising, on ltx-core: its LATENT and CONDITIONING layouts, its model call
(``LTXAVModel.forward`` and every keyword it takes) and the SP Sampler, which runs ComfyUI's
sampling loop (sigmas, CFG, noise) in the pool. ComfyUI itself is never imported: these modules
reproduce its tensor contracts, and the tests compare them with the installed ComfyUI."""
