"""The denoise calls of the client: load an LTX-2 transformer on every rank, and sample a LATENT.

A ``sample`` job is described once, by :class:`SampleRequest` (ComfyUI's CONDITIONING, LATENT
and SIGMAS plus the sampler settings); its wire form is :mod:`ltx_mgpu.wire.codec`'s. This
module imports only torch and the wire (no ltx-core, no ComfyUI), so ComfyUI's process stays
light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.wire.codec import (
    DEFAULT_MODEL,
    conditioning_to_request,
    json_option,
    latent_from_result,
    latent_to_request,
)

__all__ = ["SampleRequest", "remote_load_transformer", "remote_sample"]


@dataclass(frozen=True)
class SampleRequest:
    """One ``sample`` job: what to denoise and how.

    Attributes:
        positive / negative: ComfyUI CONDITIONING (``negative`` may be None when ``cfg`` is 1).
        latent: ComfyUI LTX-2 LATENT (video, audio or audio-video NestedTensor; optional
            ``noise_mask`` / ``batch_index``).
        model: the resident name given to ``load_transformer``.
        sigmas: ComfyUI SIGMAS (1-D, ``[steps + 1]``), or None for ``steps`` of the LTX-2
            scheduler with ``scheduler`` options (``max_shift``, ``base_shift``, ``stretch``,
            ``terminal``).
        cfg: the classifier-free guidance scale; seed: ComfyUI's noise seed; sampler: the
            sampler's name (``"euler"``).
    """

    positive: Any
    negative: Any
    latent: Mapping
    model: str = DEFAULT_MODEL
    sigmas: torch.Tensor | Sequence[float] | None = None
    steps: int | None = None
    cfg: float = 1.0
    seed: int = 0
    sampler: str = "euler"
    scheduler: Mapping[str, Any] | None = None

    def to_wire(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(params, tensors)`` of the ``sample`` request (layout: :mod:`ltx_mgpu.wire.codec`).

        Raises:
            ltx_mgpu.wire.codec.RequestFormatError: inputs that are not these ComfyUI types.
        """
        params: dict[str, Any] = {"model": self.model, "cfg": float(self.cfg), "seed": int(self.seed),
                                  "sampler": self.sampler}
        params["latent"], tensors = latent_to_request(self.latent)
        params["positive"], t = conditioning_to_request(self.positive, "positive")
        tensors.update(t)
        if self.negative is not None:
            params["negative"], t = conditioning_to_request(self.negative, "negative")
            tensors.update(t)
        if self.sigmas is not None:
            tensors["sigmas"] = torch.as_tensor(self.sigmas, dtype=torch.float32).detach().cpu()
        if self.steps is not None:
            params["steps"] = int(self.steps)
        if self.scheduler:
            params["scheduler"] = {str(k): json_option(v) for k, v in self.scheduler.items()}
        return params, tensors


def remote_load_transformer(
    client,
    plan: TransformerPlan,
    *,
    name: str = DEFAULT_MODEL,
    timeout: float | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> dict:
    """Load (or keep, when unchanged) the LTX-2 transformer ``plan`` describes on every rank of
    ``client``'s pool, resident as ``name`` (the name ``SampleRequest.model`` refers to).

    Args:
        client: a :class:`ltx_mgpu.client.pool_client.PoolClient`.
        plan: the :class:`~ltx_mgpu.denoise.plan.TransformerPlan` (paths as the pool sees them).
    Returns:
        The job result: ``model``, ``reused``, ``version``, ``plan`` (as the pool resolved it),
        ``valid_world_sizes``, ``heads``, ``bytes``, ... (``ltx_mgpu.pool.denoise_jobs.load_transformer``).
    Raises:
        ltx_mgpu.client.errors.BadInputError: a missing or unsupported file, heads the pool's
            GPU count does not divide (the message lists the counts that work), a bad LoRA.
        Other ``PoolError`` s as ``PoolClient.request``.
    """
    params = {**plan.to_params(), "name": name}
    return client.request("load_transformer", params, timeout=timeout, should_cancel=should_cancel)[0]


def remote_sample(
    client,
    request: SampleRequest,
    *,
    on_progress: Callable[[str, int, int], Any] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    timeout: float | None = None,
) -> dict:
    """Denoise ``request.latent`` in the pool (sequence-parallel over its ranks); returns the LATENT.

    ``on_progress(phase, step, total)`` runs once per denoising step (phase ``"denoise"``);
    ``should_cancel()`` is polled and a True stops the job at the next step boundary
    (``JobCancelledError``).

    Returns:
        A copy of ``request.latent`` with the denoised ``samples`` (same structure,
        NestedTensor class, dtype and device), like ComfyUI's ``SamplerCustomAdvanced`` output.
    Raises:
        ltx_mgpu.client.errors.BadInputError: unsupported conditioning keys, a LATENT that is
            not LTX-2's, too many tokens for ``max_tokens``, no such model loaded, ...;
        JobCancelledError, PoolTimeoutError, PoolFatalError as ``PoolClient.request``.
    """
    params, tensors = request.to_wire()
    result, out = client.request("sample", params, tensors, on_progress=on_progress, should_cancel=should_cancel,
                                 timeout=timeout)
    return latent_from_result(request.latent, result["latent"], out)
