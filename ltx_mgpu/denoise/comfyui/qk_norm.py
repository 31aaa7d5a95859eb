"""ComfyUI's epsilon in the query / key RMSNorms of LTX-2's attention, on ltx-core's modules.

ComfyUI's LTX-2 attention (``CrossAttention`` in ``comfy/ldm/lightricks/model.py``, used by the
transformer blocks of ``av_model.py`` and the text connectors of ``embeddings_connector.py``)
normalises its queries and keys with ``RMSNorm(inner_dim, eps=1e-5)``, whatever the checkpoint's
config says. ltx-core 1.0.0's ``Attention`` (``ltx_core/model/transformer/attention.py``) builds
them with its ``norm_eps``: the config's ``norm_eps`` (``1e-6`` in the LTX-2 and LTX-2.3 files)
for the transformer, the default ``1e-6`` for ``Embeddings1DConnector``. The two agree only to
``eps`` over the squared RMS of a head-row of queries or keys, a relative difference that
classifier-free guidance multiplies over the steps.

:func:`use_comfy_qk_norm_eps` sets :data:`COMFY_QK_NORM_EPS` on those norms of loaded ltx-core
modules (the ``eps`` attribute of each ``torch.nn.RMSNorm``, per instance; ltx-core's code is not
changed), so the transformer and the connectors compute ComfyUI's norms. Every other norm keeps
ltx-core's epsilon, which is ComfyUI's there too (the blocks' ``rms_norm`` and the output
``LayerNorm``: ``1e-6``).
"""

from __future__ import annotations

import torch
from ltx_core.model.transformer.attention import Attention

__all__ = ["COMFY_QK_NORM_EPS", "use_comfy_qk_norm_eps"]

#: The epsilon of the query and key RMSNorms in ComfyUI's LTX-2 attention (``CrossAttention``).
COMFY_QK_NORM_EPS = 1e-5


def use_comfy_qk_norm_eps(module: torch.nn.Module) -> int:
    """Give every ltx-core ``Attention`` inside ``module`` (itself included) ComfyUI's query / key
    RMSNorm epsilon (:data:`COMFY_QK_NORM_EPS`), in place. Call it before the blocks are compiled
    (``torch.compile`` bakes the value in).

    Returns:
        How many attention modules were changed (0: ``module`` holds none).
    """
    count = 0
    for m in module.modules():
        if isinstance(m, Attention):
            m.q_norm.eps = COMFY_QK_NORM_EPS
            m.k_norm.eps = COMFY_QK_NORM_EPS
            count += 1
    return count
