"""LTX-2 files that lie are refused at load, naming the key, never loaded to give NaN velocities:
an fp8 file's NaN ``scale_weight`` or NaN e4m3 weight byte, a dense weight holding NaN or an
infinity, a NaN in a separate connectors file, and a weight shorter than the config says (every
tensor is checked finite as it is read: ``ltx_mgpu.finite``; the shapes against the config
before any is read). The same on a 2-rank pool with sharded weights, where one rank's rows hold
the NaN: ``tests/integration/test_hostile.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.denoise.checkpoint import CheckpointError
from ltx_mgpu.denoise.model import export_transformer_only, load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan

P = "model.diffusion_model."
Q = P + "transformer_blocks.1.attn1.to_q"


def _rewrite(src, dst, **change) -> str:
    """``src`` with the tensors ``change`` (key -> tensor, or a function of the stored one) replaced."""
    sd = load_file(str(src))
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    for key, value in change.items():
        sd[key] = value(sd[key]) if callable(value) else value
    save_file(sd, str(dst), metadata=meta)
    return str(dst)


@pytest.fixture(scope="module")
def fp8_file(tiny_ltx_23, tmp_path_factory):
    """The tiny LTX-2.3 checkpoint (connectors included) as ComfyUI scaled fp8."""
    return export_transformer_only(tiny_ltx_23, tmp_path_factory.mktemp("fp8") / "tiny_fp8.safetensors", fp8="scaled")


def _nan_byte(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(torch.uint8)[-1, -1] = 0x7F  # e4m3's NaN, in the last row
    return t


def _set(value, at=(-1, -1)):
    def change(t):
        t = t.clone()
        t[at] = value
        return t
    return change


@pytest.mark.parametrize("key, change, dtype", [
    (Q + ".scale_weight", torch.tensor(float("nan")), "fp32"),
    (Q + ".scale_weight", torch.tensor(float("inf")), "bf16"),
    (Q + ".weight", _nan_byte, "fp32"),
], ids=["nan_scale", "inf_scale", "nan_weight_byte"])
def test_an_fp8_file_with_a_non_finite_scale_or_weight_is_refused_naming_the_key(fp8_file, tmp_path, key, change,
                                                                                 dtype):
    bad = _rewrite(fp8_file, tmp_path / "bad.safetensors", **{key: change})
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.1\.attn1\.to_q\.(weight|scale_weight)\b.* holds "
                                              r"NaN or infinite values; the file is damaged: download it again"):
        load_ltx_model(TransformerPlan(bad, dtype=dtype))


@pytest.mark.parametrize("key, value", [
    (Q + ".weight", float("nan")), (P + "patchify_proj.weight", float("inf")), (P + "scale_shift_table", float("-inf")),
    (P + "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight", float("nan")),
], ids=["block_weight", "root_weight", "table", "connector"])
def test_a_dense_file_with_a_non_finite_value_is_refused_naming_the_key(tiny_ltx_23, tmp_path, key, value):
    bad = _rewrite(tiny_ltx_23, tmp_path / "bad.safetensors", **{key: _set(value)})
    with pytest.raises(CheckpointError, match=rf"{key[len(P):]}.* holds NaN or infinite values"):
        load_ltx_model(TransformerPlan(bad, dtype="fp32"))


def test_a_separate_connectors_file_with_a_nan_is_refused_naming_the_key(tiny_ltx_23, tmp_path):
    key = P + "audio_embeddings_connector.transformer_1d_blocks.0.ff.net.0.proj.weight"
    conn = _rewrite(tiny_ltx_23, tmp_path / "connectors.safetensors", **{key: _set(float("nan"))})
    with pytest.raises(CheckpointError, match=r"connectors\.safetensors.*audio_embeddings_connector\.transformer_1d"
                                              r"_blocks\.0\.ff\.net\.0\.proj\.weight.* holds NaN or infinite values"):
        load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", connectors=conn))


def test_a_weight_of_another_shape_than_the_config_is_refused_naming_it(fp8_file, tmp_path):
    short = _rewrite(fp8_file, tmp_path / "short.safetensors", **{Q + ".weight": lambda t: t[:-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.1\.attn1\.to_q\.weight is \[31, 32\]; the "
                                              r"metadata LTX-2\.3 config makes it \[32, 32\].*another model"):
        load_ltx_model(TransformerPlan(short, dtype="fp32"))
    with safe_open(short, "pt") as f:
        assert json.loads(f.metadata()["config"])  # the file keeps its config: the weights lie, not the header
