"""One LTX-2 model call on ComfyUI's own model and on the transformer our pool runs, in ComfyUI's process.

Used by ``tests/comfyui/test_comfyui_call.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_call_run.py SPEC.json OUT.json

``SPEC.json``: ``{"comfyui": dir, "checkpoints": {version: path}, "sigmas": [...]}``. For each
checkpoint it loads ComfyUI's ``LTXAVModel`` (``load_checkpoint_guess_config``: fp32 on the CPU)
and our denoiser (``load_ltx_model`` in fp32, in this process: what every pool rank loads, at world
size 1), and gives both the same unprocessed text (a cond and an uncond prompt, batched as
``CFGGuider`` batches them) and the same audio-video latent, ComfyUI's side through its
``preprocess_text_embeds`` and ``LTXAVModel.forward``, ours through
:func:`~ltx_mgpu.denoise.comfyui.forward.processed_context` and
:func:`~ltx_mgpu.denoise.comfyui.forward.comfy_forward` under the AV timestep convention the pack
picks for this ComfyUI. It writes ``OUT.json``: per version and sigma the max relative difference
(max |delta| / max |ComfyUI's|) of the processed contexts and of the velocities, video and audio
apart, as loaded (``"ours"``) and with the attention's query / key RMSNorms at ltx-core's own
epsilon again (``"ltx_core_eps"``: the config's ``norm_eps`` in the transformer, ltx-core's
default in the connectors), and the convention used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from comfyui_support import load_pack_in_process  # noqa: E402 - this script runs from tests/

#: ltx-core 1.0.0's default ``norm_eps`` of ``Attention`` (the connectors' query / key norms).
LTX_CORE_ATTENTION_EPS = 1e-6


def _rel(ours, theirs) -> float:
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp(min=1e-12))


def main() -> int:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.sd
    import torch
    from ltx_core.model.transformer.attention import Attention

    load_pack_in_process()
    convention = sys.modules["ltx_mgpu_pack.nodes._model"].av_timestep_convention()
    from ltx_mgpu.denoise.comfyui.forward import av_timestep_convention, comfy_forward, processed_context
    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.denoise.plan import TransformerPlan

    report: dict = {"convention": convention, "versions": {}}
    for version, path in spec["checkpoints"].items():
        dm = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False)[0].model.diffusion_model
        ours = load_ltx_model(TransformerPlan(path, dtype="fp32"))
        g = torch.Generator().manual_seed(7)
        widths = ours.context_widths  # LTX-2.3 splits the text into [video | audio]; LTX-2.0 gives both all of it
        width = sum(widths) if ours.config["transformer"].get("caption_proj_before_connector") else widths[0]
        text = torch.randn(2, 9, width, generator=g)  # cond, uncond
        x = [torch.randn(2, 128, 2, 2, 3, generator=g), torch.randn(2, 8, 9, 16, generator=g)]
        eps = {"ours": None, "ltx_core_eps": (ours.config["transformer"].get("norm_eps", 1e-6), LTX_CORE_ATTENTION_EPS)}
        entry = report["versions"][version] = {}
        for sigma in spec["sigmas"]:
            t = (torch.full((2,), sigma), torch.full((2,), sigma))
            with torch.no_grad():
                ctx = torch.cat([dm.preprocess_text_embeds(text[i:i + 1], unprocessed=True) for i in range(2)])
                want = dm([p.clone() for p in x], t, ctx, None, frame_rate=25.0, transformer_options={})
            for name, norm_eps in eps.items():
                saved = []
                if norm_eps is not None:
                    for module, value in zip((ours.transformer, ours.video_connector, ours.audio_connector),
                                             (norm_eps[0], norm_eps[1], norm_eps[1])):
                        for m in module.modules():
                            if isinstance(m, Attention):
                                saved.append((m, m.q_norm.eps))
                                m.q_norm.eps = m.k_norm.eps = value
                try:
                    with torch.no_grad(), av_timestep_convention(ours.transformer, convention):
                        our_ctx = torch.cat([processed_context(ours, text[i:i + 1], True) for i in range(2)])
                        got = comfy_forward(ours, ours.transformer, [p.clone() for p in x], t, our_ctx,
                                            frame_rate=25.0)
                finally:
                    for m, value in saved:
                        m.q_norm.eps = m.k_norm.eps = value
                split = widths[0]  # processed: [video | audio]
                entry.setdefault(name, {})[str(sigma)] = {
                    "context_video": _rel(our_ctx[..., :split], ctx[..., :split]),
                    "context_audio": _rel(our_ctx[..., split:], ctx[..., split:]),
                    "video": _rel(got[0], want[0]), "audio": _rel(got[1], want[1])}
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
