"""Checks the subcommands share, made on the arguments before any work."""

from __future__ import annotations

import glob
import os

__all__ = ["check_device", "check_paths_exist", "cpu_ranks_instead", "nvidia_gpus_present"]


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


def check_paths_exist(**paths: str | os.PathLike | None) -> None:
    """Refuse a model path that does not exist, by its flag (``gemma="..."`` is ``--gemma``),
    before torch is imported (a stat each; what the file holds is checked once torch is there).

    Raises:
        FileNotFoundError: ``"--<flag> <path>: no such file or directory"``.
    """
    for flag, path in paths.items():
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {path}: no such file or directory")


def nvidia_gpus_present() -> bool:
    """Whether the operating system shows NVIDIA GPUs (the driver's ``/proc/driver/nvidia/gpus``
    entries or ``/dev/nvidia<N>`` device files), whatever torch sees. Imports nothing."""
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def cpu_ranks_instead(asked: str, ranks: int, explicit: str) -> str:
    """The decision for GPUs asked for (``asked``, e.g. ``"--gpus 2"``) where torch sees no CUDA
    GPU: where the machine has none either, a run on ``ranks`` CPU ranks is what the user can
    have (the way to try the pack without GPUs, as the README's main job does), so it goes on
    with one warning line, returned here; where the machine has NVIDIA GPUs that torch cannot
    see (a CPU-only torch build, or ``CUDA_VISIBLE_DEVICES`` hiding them), a CPU run of a real
    model would take hours unnoticed, so it is refused. ``explicit``: the flags that ask for CPU
    ranks (which silence the warning and pass the refusal). ``docs/operations.md`` says the same.

    Raises:
        ValueError: the machine has NVIDIA GPUs that torch does not see (naming the fixes).
    """
    if nvidia_gpus_present():
        import torch  # deferred: callers have imported it already; this module stays light

        why = ("CUDA_VISIBLE_DEVICES hides them" if os.environ.get("CUDA_VISIBLE_DEVICES") is not None
               else f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else "torch cannot use them (driver or CUDA version?)")
        raise ValueError(f"{asked}: this machine has NVIDIA GPUs but torch sees none ({why}); install a CUDA "
                         f"build of torch, or ask for CPU ranks with {explicit}")
    cores = os.cpu_count() or 1
    return (f"warning: {asked}: torch sees no GPU here, so this runs {ranks} CPU rank{'s' if ranks != 1 else ''} "
            f"(gloo) on {cores} CPU core{'s' if cores != 1 else ''}; ask for CPU ranks with {explicit} to silence "
            "this")
