"""A generation's prompt ids and its text, exactly as ComfyUI's LTX-2 Gemma tokenizer makes and
decodes them: :class:`GenerationTokenizer`.

ComfyUI's ``CLIP.tokenize`` (``Gemma3_12BTokenizer`` in ``comfy/text_encoders/lt.py`` on
``SDTokenizer`` in ``comfy/sd1_clip.py`` and ``SPieceTokenizer`` in
``comfy/text_encoders/spiece_tokenizer.py``) turns the (templated) prompt into ids this way, which
:meth:`GenerationTokenizer.prompt_ids` follows step by step:

1. ``\\(`` and ``\\)`` lose their backslash (``escape_important`` / ``unescape_important``);
   prompt weights are off, so the text is one piece (the ``embedding:`` syntax is refused where
   the prompt is tokenized, ``nodes/_clip.py``).
2. SentencePiece encodes it with ``<bos>`` first. When the text holds ``<image_soft_token>`` or
   ``<end_of_turn>`` (``Gemma3_12BTokenizer``'s ``special_tokens``), the text is split around them,
   each of them becomes its id (262144 and 106: hard-coded for Gemma 3 12B) and each other part
   is encoded *without* ``<bos>``. Other control pieces (``<start_of_turn>``, ``<bos>``...)
   written in the text are not matched by SentencePiece: they are spelled out as text.
3. ``SDTokenizer`` drops the first id of that (it expects ``<bos>`` there) and puts ``<bos>``
   (2) first. So when the text held a special token, the first id of the text itself is lost:
   for ``TextGenerateLTX2Prompt``'s prompt, the ``<`` of its leading ``<start_of_turn>``.
4. The row is left-padded with ``<pad>`` (0) to 1024 ids (``min_length``; ``TextGenerate``'s
   ``min_length=1`` does not reach it). ComfyUI's ``generate`` then runs Gemma on all of them,
   the pads included, without an attention mask (``BaseGenerate.generate`` in
   ``comfy/text_encoders/llama.py``); :mod:`~ltx_mgpu.text.generate.causal_lm` does the same.

Decoding (``CLIP.decode`` -> ``SPieceTokenizer.decode(skip_special_tokens=True)``) drops the ids
of those two special tokens and SentencePiece-decodes the rest (control ids decode to nothing).

The SentencePiece model is the source's own: a ComfyUI file's ``spiece_model``, a
``tokenizer.model`` beside or in the source, a GGUF's vocabulary
(``ltx_mgpu.text.gemma.gguf_file``). A source with only a ``tokenizer.json`` (which ComfyUI cannot
load) is tokenized with transformers' tokenizer instead, its special tokens split as text: that
matches SentencePiece on ordinary text but not on every run of spaces of Gemma 3's vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ltx_mgpu.text.gemma.comfy_file import open_comfy_file
from ltx_mgpu.text.gemma.gguf_file import open_gemma_gguf
from ltx_mgpu.text.gemma.sources import GemmaFormatError
from ltx_mgpu.text.gemma.tokenizer import comfy_unescape
from ltx_mgpu.text.gemma.tower import GemmaTextTower

__all__ = ["BOS", "PAD", "IMAGE_SOFT_TOKEN", "COMFY_SPECIAL_TOKENS", "GenerationTokenizer", "sentencepiece_model"]

#: Gemma's ``<bos>`` and ``<pad>`` ids (ComfyUI's ``special_tokens={"start": 2, "pad": 0}``).
BOS, PAD = 2, 0
#: ComfyUI's id of ``<image_soft_token>`` (Gemma 3 12B's).
IMAGE_SOFT_TOKEN = 262144
#: ``Gemma3_12BTokenizer``'s ``special_tokens``: matched in the text, dropped when decoding.
COMFY_SPECIAL_TOKENS = {"<image_soft_token>": IMAGE_SOFT_TOKEN, "<end_of_turn>": 106}
_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in COMFY_SPECIAL_TOKENS) + ")")


def sentencepiece_model(tower: GemmaTextTower) -> bytes | None:
    """The serialized SentencePiece model of ``tower``'s source: a ``tokenizer.model`` among its
    files, a ComfyUI file's embedded ``spiece_model``, a GGUF file's vocabulary, or a
    ``tokenizer.model`` in its directory; None when it has none (only a ``tokenizer.json``)."""
    path = Path(tower.path)
    for f in tower.files:
        if Path(f).name == "tokenizer.model":
            return Path(f).read_bytes()
    if tower.format == "comfy_file":
        return open_comfy_file(path).spm
    if tower.format == "gguf_file":
        src = open_gemma_gguf(path)
        try:
            return src.spm() if src.has_tokenizer else None
        except GemmaFormatError:
            return None
    if path.is_dir() and (path / "tokenizer.model").is_file():
        return (path / "tokenizer.model").read_bytes()
    return None


class GenerationTokenizer:
    """ComfyUI's tokenization and decoding of a generation (module doc) for one loaded tower.

    Args:
        tower: the loaded text tower (its ``tokenizer`` is the fallback).
        spm: the source's SentencePiece model (:func:`sentencepiece_model`); None: use
            ``tower.tokenizer`` (transformers'), special tokens split as text.
    """

    def __init__(self, tower: GemmaTextTower, spm: bytes | None):
        self.hf = tower.tokenizer
        self.sp = None
        if spm is not None:
            import sentencepiece  # deferred: only SentencePiece tokenizers need it

            self.sp = sentencepiece.SentencePieceProcessor(model_proto=spm)

    @property
    def kind(self) -> str:
        """``"sentencepiece"`` or ``"transformers"``: what encodes and decodes."""
        return "sentencepiece" if self.sp is not None else "transformers"

    def _encode(self, text: str) -> list[int]:
        """The ids of ``text`` without ``<bos>`` (SentencePiece's ``encode``: control pieces in the
        text are spelled out)."""
        if self.sp is not None:
            return list(self.sp.encode(text, add_bos=False, add_eos=False))
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def prompt_ids(self, text: str, pad_to: int) -> list[int]:
        """The ids ComfyUI's ``clip.tokenize(text)`` gives Gemma for ``generate`` (module doc):
        ``<bos>`` first, left-padded with ``<pad>`` to ``pad_to`` ids (none added to a longer row).

        Raises:
            ValueError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise ValueError(f"the prompt must be a string, got {type(text).__name__}")
        text = comfy_unescape(text)
        if text == "":
            ids: list[int] = []
        elif _SPECIAL.search(text):
            parts = [p for p in _SPECIAL.split(text) if p]
            ids = [i for p in parts for i in ([COMFY_SPECIAL_TOKENS[p]] if p in COMFY_SPECIAL_TOKENS
                                              else self._encode(p))]
            ids = ids[1:]  # SDTokenizer drops the id where it expects the tokenizer's <bos>
        else:
            ids = self._encode(text)
        row = [BOS, *ids]
        return [PAD] * max(0, pad_to - len(row)) + row

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """``CLIP.decode(ids)``: with ``skip_special_tokens`` the ids of
        :data:`COMFY_SPECIAL_TOKENS` are dropped; the rest is SentencePiece-decoded (control ids
        give nothing).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            drop = set(COMFY_SPECIAL_TOKENS.values())
            ids = [i for i in ids if i not in drop]
        size = self.sp.get_piece_size() if self.sp is not None else len(self.hf)
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the tokenizer's {size} pieces")
        if self.sp is not None:
            return str(self.sp.decode(ids))
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def vocab_size(self) -> int:
        """The tokenizer's number of pieces."""
        return int(self.sp.get_piece_size()) if self.sp is not None else len(self.hf)

    def __repr__(self) -> str:
        return f"GenerationTokenizer({self.kind})"
