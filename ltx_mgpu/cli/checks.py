"""Checks the subcommands share, made on the arguments before any work."""

from __future__ import annotations

__all__ = ["check_device"]


def check_device(name: str | None) -> None:
    """Refuse a device torch cannot use here, before any loading.

    Raises:
        ValueError: not a device name, or a CUDA device without a CUDA GPU (the message says what to pass).
    """
    if name is None:
        return
    import torch  # deferred: --help and argument errors stay fast

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA GPU here (a CPU-only build, or no driver); "
                         "use --device cpu")
