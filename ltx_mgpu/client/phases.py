"""The phases of a run as a person reads them.

A pool job reports ``(phase, step, total)`` events (``load_text_encoder``, ``encode``,
``denoise``...); the client adds its own phases (``pool``: starting or attaching to the pool,
``load_transformer``). :func:`phase_text` names a phase with its count and elapsed time
(``"loading Gemma · 12 s"``), the words the CLI, ComfyUI's node text and the panel all show
(``ltx_mgpu.heartbeat`` keeps a phase without steps of its own visibly moving).
"""

from __future__ import annotations

__all__ = ["PHASE_LABELS", "phase_label", "phase_text"]

#: Phase id -> what a person reads.
PHASE_LABELS = {
    "pool": "starting the pool",
    "attach": "connecting to the pool",
    "convert": "converting the model",
    "load_text_encoder": "loading Gemma",
    "encode": "encoding the prompts",
    "compile": "compiling",
    "load_transformer": "loading the LTX-2 transformer",
    "denoise": "denoising",
    "decode": "decoding",
    "selftest": "self-test",
}


def phase_label(phase: str) -> str:
    """:data:`PHASE_LABELS`' words for ``phase``, else the phase itself (underscores as spaces)."""
    return PHASE_LABELS.get(phase, phase.replace("_", " "))


def phase_text(phase: str, elapsed: float, step: int | None = None, total: int | None = None) -> str:
    """``"denoising 3/20 · 41 s"``: the label, ``step/total`` when there are several steps, and the
    whole seconds elapsed since the phase began."""
    count = f" {step}/{total}" if total and total > 1 and step is not None else ""
    return f"{phase_label(phase)}{count} · {max(0, int(elapsed))} s"
