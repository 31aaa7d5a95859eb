"""Whether a tensor holds a NaN or an infinite value, checked as it is read: :func:`nonfinite`,
:func:`is_finite` and :class:`FiniteCheck` (many tensors, read back once).

A file that lies (a NaN scale, a NaN weight) must be refused at load, naming the tensor, never
loaded to return NaN later. The check has to cost little next to reading the tensor, so it is
one reduction per tensor with no temporary of the tensor's size: ``torch.aminmax`` of a float
tensor (a NaN propagates into both, an infinity into one of them), which runs at memory speed,
where ``torch.isfinite(t).all()`` writes a bool tensor first and runs many times slower on the
CPU (``benchmarks/bench_finite_checks.py`` measures both). Float8 tensors are read through their
bytes, where NaN and infinity are the largest codes: e4m3fn's NaN is ``0x7F`` / ``0xFF`` (no
infinity), e5m2's infinities and NaNs are ``0x7C..0x7F`` / ``0xFC..0xFF``, so the maximum of the
bytes read as ``int8`` (positive codes) and as ``uint8`` (negative codes) tells (the formats'
definitions: OCP 8-bit floating point specification, as ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` implement it). Integer tensors are always finite.
"""

from __future__ import annotations

import torch

__all__ = ["FiniteCheck", "is_finite", "nonfinite"]

#: For each float8 dtype, the smallest (int8 view, uint8 view) maximum that means a NaN or an
#: infinity: a positive code at or above the first, or a negative one at or above the second.
_FLOAT8_LIMITS = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7C, 0xFC)}


def nonfinite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool tensor on ``t``'s device, True when ``t`` holds a NaN or an infinite value
    (computed there, not read back: no host synchronisation), or None when it cannot hold one
    (an integer or bool tensor, an empty one)."""
    if not t.numel() or not (t.is_floating_point() or t.is_complex()):
        return None
    if t.is_complex():
        t = torch.view_as_real(t)
    limits = _FLOAT8_LIMITS.get(t.dtype)
    if limits is not None:
        positive, negative = limits
        return (t.view(torch.int8).max() >= positive) | (t.view(torch.uint8).max() >= negative)
    if t.dtype.itemsize == 1:  # another float8 (fnuz: NaN is the code 0x80): the plain way
        return ~torch.isfinite(t.float()).all()
    lo, hi = torch.aminmax(t)
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def is_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN and no infinite value (reads the answer back at once)."""
    flag = nonfinite(t)
    return flag is None or not bool(flag)


class FiniteCheck:
    """Tensors checked as they are read and read back once: :meth:`add` queues each one's
    :func:`nonfinite` flag on its device (no synchronisation per tensor on a GPU), :meth:`first`
    reads them all back together and names the first tensor that is not finite."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._flags: list[torch.Tensor] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        """Queue ``t``'s check under ``name`` (a key, for the message)."""
        flag = nonfinite(t)
        if flag is not None:
            self._names.append(name)
            self._flags.append(flag.reshape(1))

    def first(self) -> str | None:
        """The name of the first queued tensor that holds a NaN or an infinite value, or None;
        the queue is emptied."""
        names, flags = self._names, self._flags
        self._names, self._flags = [], []
        if not flags:
            return None
        by_device: dict[torch.device, list[int]] = {}
        for i, f in enumerate(flags):
            by_device.setdefault(f.device, []).append(i)
        bad = []
        for idx in by_device.values():
            read = torch.cat([flags[i] for i in idx]).cpu()
            bad += [idx[j] for j in torch.nonzero(read).flatten().tolist()]
        return names[min(bad)] if bad else None
