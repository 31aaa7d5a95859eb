"""What the fp8 tests share: the tolerance, the deep tiny model's size, the relative error, and
the tiny model exported as a float32 and a ComfyUI scaled-fp8 file.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from sp_harness import build_tiny_model, tiny_config

from ltx_mgpu.denoise.model import export_transformer_only

REL = 1e-5
DEEP = {"num_layers": 8}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius, float32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def tiny_files(tmp_path) -> tuple[str, str]:
    """(float32 transformer-only file, the same exported as ComfyUI scaled fp8) of the 8-block
    tiny model of ``sp_harness``."""
    model = build_tiny_model(**DEEP)
    src = tmp_path / "tiny_f32.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src),
              metadata={"config": json.dumps(tiny_config(**DEEP))})
    dst = export_transformer_only(src, tmp_path / "tiny_fp8.safetensors", prefix="", fp8="scaled")
    return str(src), str(dst)
