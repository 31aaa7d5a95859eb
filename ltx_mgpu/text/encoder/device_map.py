"""The Accelerate placement's split of a Gemma 3 text tower over several devices.

``device_map="balanced"`` leaves GPUs unused for Gemma 3 12B (it gives each GPU but the last
``total/n + 1.25 x largest leaf``, and the 2 GB embedding is the largest leaf: 4 GPUs fill 3,
8 fill 5; accelerate's ``get_balanced_memory``, ``accelerate/utils/modeling.py``). This
module computes an explicit device map instead: contiguous decoder-layer groups, at least one
layer per device, bytes spread in proportion to a per-device budget (even by default), then
dispatches the model with Accelerate's hooks, which carry activations across devices.
Execution stays sequential: the split buys memory, not speed.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Mapping, Sequence

import torch

__all__ = ["describe_device_map", "dispatch_text_tower", "gemma_device_map", "plan_layer_split"]


def _module_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters(recurse=True)) + list(module.buffers(recurse=True))
    return int(sum(t.numel() * t.element_size() for t in tensors))


def plan_layer_split(layer_bytes: Sequence[int], head_bytes: int, tail_bytes: int,
                     budgets: Sequence[float]) -> list[int]:
    """Split a stack of layers over devices: contiguous, non-empty groups, device 0 also
    holding the head (embedding) and the last device the tail (final norm), minimising the
    largest ``bytes_d / budgets[d]`` (an exact dynamic programme, ``O(n L^2)``).

    Returns:
        The number of layers on each device (sums to ``len(layer_bytes)``, each >= 1).

    Raises:
        ValueError: fewer layers than devices, or a non-positive budget.
    """
    n, num = len(budgets), len(layer_bytes)
    if n < 1 or num < n:
        raise ValueError(f"cannot give each of {n} device(s) a decoder layer: the model has {num}")
    if any(b <= 0 for b in budgets):
        raise ValueError(f"device budgets must be positive, got {list(budgets)}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    def cost(d: int, i: int, j: int) -> float:  # layers i..j-1 on device d
        extra = (head_bytes if d == 0 else 0) + (tail_bytes if d == n - 1 else 0)
        return (prefix[j] - prefix[i] + extra) / budgets[d]

    inf = float("inf")
    best = [[inf] * (num + 1) for _ in range(n)]  # best[d][j]: layers 0..j-1 on devices 0..d
    cut = [[0] * (num + 1) for _ in range(n)]
    for j in range(1, num + 1):
        best[0][j] = cost(0, 0, j)
    for d in range(1, n):
        for j in range(d + 1, num + 1):
            for i in range(d, j):
                v = max(best[d - 1][i], cost(d, i, j))
                if v < best[d][j]:
                    best[d][j], cut[d][j] = v, i
    counts, j = [], num
    for d in range(n - 1, 0, -1):
        i = cut[d][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def gemma_device_map(model: torch.nn.Module, devices: Sequence[torch.device | str],
                     max_memory: Mapping[int, int] | None = None) -> dict[str, str]:
    """An explicit Accelerate ``device_map`` for a ``Gemma3TextModel``: ``embed_tokens`` and
    ``rotary_emb`` (and any other non-layer child) on ``devices[0]``, ``norm`` on the last,
    the decoder layers split by :func:`plan_layer_split` over bytes of parameters and buffers
    (NF4 layers count at their packed size).

    Args:
        devices: the devices, in order (pipeline order of the layers).
        max_memory: bytes allowed per device index; the split follows these proportions and
            each device's share must fit its budget. ``None``: an even split, no limit.

    Raises:
        ValueError: fewer layers than devices, a budget missing or not positive, or a
            device whose share exceeds its budget (the message gives the numbers).
    """
    devices = [str(torch.device(d)) for d in devices]
    if max_memory is not None and sorted(max_memory) != list(range(len(devices))):
        raise ValueError(f"max_memory must give a byte budget for each device index 0..{len(devices) - 1}, "
                         f"got keys {sorted(max_memory)}")
    budgets = [float(max_memory[i]) for i in range(len(devices))] if max_memory else [1.0] * len(devices)
    layers = model.layers
    others = [name for name, _ in model.named_children() if name not in ("layers", "norm")]
    head = sum(_module_bytes(getattr(model, name)) for name in others)
    tail = _module_bytes(model.norm)
    sizes = [_module_bytes(layer) for layer in layers]
    counts = plan_layer_split(sizes, head, tail, budgets)
    device_map = {name: devices[0] for name in others}
    start = 0
    for d, count in enumerate(counts):
        for i in range(start, start + count):
            device_map[f"layers.{i}"] = devices[d]
        start += count
    device_map["norm"] = devices[-1]
    if max_memory:
        start = 0
        for d, count in enumerate(counts):
            need = sum(sizes[start:start + count]) + (head if d == 0 else 0) + (tail if d == len(devices) - 1 else 0)
            start += count
            if need > max_memory[d]:
                raise ValueError(f"the Gemma text tower needs {need / 2**30:.2f} GiB of weights on {devices[d]}, over "
                                 f"its max_memory of {max_memory[d] / 2**30:.2f} GiB; raise max_memory, use more "
                                 "GPUs or weights='nf4'")
    return device_map


def dispatch_text_tower(tower, devices: Sequence[torch.device | str],
                        max_memory: Mapping[int, int] | None = None) -> dict[str, str]:
    """Spread a loaded tower's model over ``devices`` (Accelerate placement) in place.

    Each block of :func:`gemma_device_map` is moved with ``nn.Module.to`` (the move
    bitsandbytes supports for NF4 ``Linear4bit`` since 0.43.2), then
    ``accelerate.dispatch_model`` attaches the hooks that carry activations between devices
    and return the outputs (every hidden state) to the input's device, ``devices[0]``. Hooks are
    attached even for one device, so a CPU pool runs the same code path as a GPU pool.

    Returns:
        The device map used (module name -> device string).

    Raises:
        ValueError: as :func:`gemma_device_map`.
    """
    from accelerate import dispatch_model

    model = tower.model
    device_map = gemma_device_map(model, devices, max_memory)
    for name, device in device_map.items():
        model.get_submodule(name).to(device)
    with _quiet_cpu_offload_warning(all(d == "cpu" for d in device_map.values())):
        dispatch_model(model, device_map=device_map, main_device=device_map["embed_tokens"], force_hooks=True)
    return device_map


@contextlib.contextmanager
def _quiet_cpu_offload_warning(active: bool):
    """Accelerate warns "Some parameters are on the meta device because they were offloaded to
    the cpu" whenever a device map names the CPU, even when it is the execution device and
    nothing is offloaded (a CPU pool); drop that line then."""
    logger = logging.getLogger("accelerate.big_modeling")

    def keep(record: logging.LogRecord) -> bool:
        return "offloaded to the cpu" not in record.getMessage()

    if active:
        logger.addFilter(keep)
    try:
        yield
    finally:
        if active:
            logger.removeFilter(keep)


def describe_device_map(device_map: Mapping[str, str] | None) -> dict[str, list[int]] | None:
    """``{device: [layer indices]}`` of a Gemma device map (for logs and ``status``)."""
    if not device_map:
        return None
    out: dict[str, list[int]] = {}
    for name, device in device_map.items():
        if name.startswith("layers."):
            out.setdefault(device, []).append(int(name.split(".")[1]))
    return out
