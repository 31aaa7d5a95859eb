"""ComfyUI's audio-video latent container, without ComfyUI.

ComfyUI holds an LTX-2 audio-video latent as ``comfy.nested_tensor.NestedTensor``: a plain
Python object with a ``tensors`` list (video ``[B, 128, F, H, W]`` first, then audio
``[B, 8, N, 16]``), ``is_nested = True``, and ``shape`` / ``device`` / ``dtype`` reporting
the first tensor's (ComfyUI ``comfy/nested_tensor.py``; ``LTXVConcatAVLatent``). It is not
``torch.nested``. This module gives the engine and the nodes one duck-typed test for it and
one stand-in class; it imports only torch, so the nodes can use it in ComfyUI's process.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["NestedTensorLike", "is_nested"]


def is_nested(x: Any) -> bool:
    """True for ComfyUI's NestedTensor or anything shaped like it (``is_nested`` and a
    ``tensors`` list or tuple); False for plain tensors and for ``torch.nested`` tensors."""
    return bool(getattr(x, "is_nested", False)) and isinstance(getattr(x, "tensors", None), (list, tuple))


class NestedTensorLike:
    """Minimal stand-in for ``comfy.nested_tensor.NestedTensor``: a list of tensors.

    ``tensors`` is the list (video first, then audio); ``shape`` / ``device`` / ``dtype``
    report the first tensor's, as ComfyUI's class does.
    """

    is_nested = True

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)

    def unbind(self) -> list[torch.Tensor]:
        return self.tensors

    def to(self, *args: Any, **kwargs: Any) -> "NestedTensorLike":
        return type(self)([t.to(*args, **kwargs) for t in self.tensors])

    def clone(self) -> "NestedTensorLike":
        return type(self)([t.clone() for t in self.tensors])

    @property
    def shape(self) -> torch.Size:
        return self.tensors[0].shape

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def __repr__(self) -> str:
        return f"NestedTensorLike({[tuple(t.shape) for t in self.tensors]})"
