"""One family for work that stopped because it was asked to (Stop in ComfyUI, Ctrl-C, a cancel
request): :class:`Cancelled`.

Every layer raises its own subclass (``ltx_mgpu.denoise.comfyui.sampler.SamplingCancelled``, the pool's
``ltx_mgpu.pool.engines.JobCancelled``, the client's ``ltx_mgpu.client.errors.JobCancelledError``,
the CLI's ``ltx_mgpu.cli.pipeline.GenerateCancelled``); ``except Cancelled`` catches any of them.
The base derives from ``BaseException`` only, like ``asyncio.CancelledError``, so that the pool's
own flavour passes through a job handler's ``except Exception``; the subclasses a caller is
expected to handle as ordinary errors also derive from ``Exception``.
"""

from __future__ import annotations

__all__ = ["Cancelled"]


class Cancelled(BaseException):
    """Work stopped at a step boundary because it was asked to; nothing partial was kept."""
