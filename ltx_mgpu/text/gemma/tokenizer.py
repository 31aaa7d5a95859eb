"""Gemma 3 tokenizers from the files users have, and tokenization exactly as ComfyUI does it.

ComfyUI (``comfy/text_encoders/lt.py``, ``Gemma3_12BTokenizer``) feeds Gemma raw text: no chat
template, ``<bos>`` prepended, no ``<eos>``, left padding with ``<pad>`` (0). Every tokenizer we
build is configured that way and checked (:func:`check_tokenizer`).

Tokenizers come from a ``tokenizer.json`` (transformers' ``AutoTokenizer``) or a SentencePiece
model (a ``tokenizer.model`` file or ComfyUI's embedded ``spiece_model`` tensor), which
transformers converts with its ``GemmaConverter`` (this needs ``protobuf`` and ``sentencepiece``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ltx_mgpu.text.gemma.sources import GemmaFormatError, TokenizerFiles, comfy_tokenizer_files, no_tokenizer_error

if TYPE_CHECKING:
    from ltx_mgpu.text.gemma.tower import GemmaTextTower

__all__ = ["PromptTooLongError", "prompt_too_long", "GEMMA_TOKENIZER_KWARGS", "tokenizer_from_spm", "load_tokenizer",
           "check_prompts", "comfy_unescape", "tokenize"]

#: How LTX-2 / ComfyUI use Gemma 3's tokenizer: BOS first, no EOS, left padding.
GEMMA_TOKENIZER_KWARGS = {"add_bos_token": True, "add_eos_token": False, "padding_side": "left"}
#: Gemma 3's special-token names, for a ``tokenizer.json`` that comes without its config file.
_GEMMA_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}


class PromptTooLongError(ValueError):
    """A prompt exceeds the token budget and truncation was not allowed."""


def prompt_too_long(index: int, tokens: int, budget: int) -> PromptTooLongError:
    """The error for prompt ``index`` of ``tokens`` tokens (BOS included) over a ``budget`` of tokens."""
    return PromptTooLongError(f"prompt {index} has {tokens} tokens (BOS included), over the budget of {budget}; "
                              "shorten it or allow truncation")


def _check_gemma_spm(data: bytes) -> None:
    """Raise unless ``data`` is a SentencePiece model that transformers' ``GemmaConverter``
    converts exactly: BPE with byte fallback, Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
    ``<unk>`` 3), identity normalisation, no dummy prefix, whitespace kept and escaped to ``▁``
    (the converter hard-codes those; ``sentencepiece_model.proto`` names the fields)."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(bytes(data))
    except DecodeError as exc:
        raise GemmaFormatError(f"not a SentencePiece model ({exc}); use Gemma 3's tokenizer.model") from exc
    spec, norm = model.trainer_spec, model.normalizer_spec
    ids = (spec.pad_id, spec.eos_id, spec.bos_id, spec.unk_id)
    gemma_like = (
        len(model.pieces) > max(ids)
        and spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE
        and spec.byte_fallback
        and ids == (0, 1, 2, 3)
        and not norm.add_dummy_prefix
        and not norm.remove_extra_whitespaces
        and norm.escape_whitespaces
        and not norm.precompiled_charsmap
    )
    if not gemma_like:
        raise GemmaFormatError(
            "the SentencePiece model is not a Gemma tokenizer (expected BPE with byte fallback, identity "
            "normalisation, no dummy prefix, whitespace escaped, and ids <pad> 0, <eos> 1, <bos> 2, <unk> 3; "
            f"got {len(model.pieces)} pieces, ids {ids}); use Gemma 3's tokenizer.model"
        )


def tokenizer_from_spm(data: bytes) -> Any:
    """A transformers ``GemmaTokenizer`` built from a serialized Gemma SentencePiece model.

    The bytes are written as ``tokenizer.model`` into a temporary directory and loaded with
    ``GemmaTokenizer.from_pretrained``, which converts them through ``GemmaConverter`` (vocabulary,
    score-ordered BPE merges, control pieces as special tokens); configured as
    :data:`GEMMA_TOKENIZER_KWARGS`. Offline: no hub access.

    Args:
        data: a SentencePiece ``ModelProto`` (Gemma 3's ``tokenizer.model``, or the bytes of
            ComfyUI's ``spiece_model`` uint8 tensor).

    Raises:
        GemmaFormatError: not a SentencePiece model, or not a Gemma-style one (see the message).
    """
    from transformers import GemmaTokenizer

    _check_gemma_spm(data)
    with tempfile.TemporaryDirectory(prefix="ltx_mgpu_spm_") as d:
        (Path(d) / "tokenizer.model").write_bytes(bytes(data))
        return GemmaTokenizer.from_pretrained(d, local_files_only=True, **GEMMA_TOKENIZER_KWARGS)


def load_tokenizer(found: TokenizerFiles) -> Any:
    """Build the tokenizer located by ``ltx_mgpu.text.gemma.sources.find_tokenizer_files``.

    A ``tokenizer.json`` goes through ``AutoTokenizer`` (Gemma's special-token names are supplied
    when ``tokenizer_config.json`` is absent, else there would be no ``<bos>``/``<pad>``); a
    ``tokenizer.model`` through :func:`tokenizer_from_spm`. Not yet checked: see
    :func:`check_tokenizer`.

    Raises:
        GemmaFormatError: a SentencePiece model that is not Gemma's (the message names the file).
    """
    if found.kind == "sentencepiece":
        try:
            return tokenizer_from_spm(found.files[0].read_bytes())
        except GemmaFormatError as exc:
            raise GemmaFormatError(f"{found.files[0]}: {exc}") from exc
    from transformers import AutoTokenizer

    names = {} if (found.directory / "tokenizer_config.json").is_file() else _GEMMA_SPECIAL_TOKENS
    return AutoTokenizer.from_pretrained(str(found.directory), **GEMMA_TOKENIZER_KWARGS, **names)


def check_tokenizer(tok: Any, source: Path) -> Any:
    """Return ``tok`` set to left padding, after checking it prepends ``<bos>``, appends no
    ``<eos>`` and has a ``<pad>`` token.

    Raises:
        GemmaFormatError: any of those does not hold (names ``source`` and the fix).
    """
    ids = tok("a")["input_ids"]
    if tok.bos_token_id is None or not ids or ids[0] != tok.bos_token_id or ids[-1] == tok.eos_token_id:
        raise GemmaFormatError(
            f"{source}: the tokenizer must prepend <bos> and not append <eos> (got {ids} for 'a'); "
            "use Gemma 3's own tokenizer files"
        )
    if tok.pad_token_id is None:
        raise GemmaFormatError(f"{source}: the tokenizer has no <pad> token; use Gemma 3's own tokenizer files")
    tok.padding_side = "left"
    return tok


def check_prompts(prompts: Sequence[str], what: str = "prompts") -> None:
    """Raise unless every prompt is a ``str`` of valid Unicode text, which the tokenizer takes.

    A lone surrogate (U+D800..U+DFFF) is not text: Python makes one of each byte of a command-line
    argument that is not UTF-8 (``$'caf\\xff'`` reaches ``sys.argv`` as ``'caf\\udcff'``), and
    a JSON string may carry one (``"\\udcff"``); the tokenizer cannot encode it.

    Raises:
        ValueError: ``"<what>[i] is <type>, expected str"`` or ``"<what>[i] is not valid Unicode text ..."``
            naming the position and the fix.
    """
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"{what}[{i}] is {type(p).__name__}, expected str")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{what}[{i}] is not valid Unicode text: a lone surrogate {p[e.start]!r} at character {e.start} "
                "(bytes that are not UTF-8, e.g. in a command-line argument or a file); send the prompt as UTF-8 text"
            ) from None


def comfy_unescape(text: str) -> str:
    """ComfyUI's ``unescape_important(escape_important(text))`` (``comfy/sd1_clip.py``)."""
    text = text.replace("\\)", "\0\1").replace("\\(", "\0\2")
    return text.replace("\0\1", ")").replace("\0\2", "(")


def tokenize(
    tower: GemmaTextTower, prompts: Sequence[str], max_length: int = 1024, truncate: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Tokenize prompts as ComfyUI does and left-pad them to the longest one in the batch.

    Each prompt is encoded as ComfyUI's ``SDTokenizer.tokenize_with_weights`` encodes it for
    Gemma (prompt weights disabled): raw text (no chat template, no stripping) except that the
    escaped parentheses ``\\(`` / ``\\)`` lose their backslash (``escape_important`` then
    ``unescape_important``, ``comfy/sd1_clip.py``); ``<bos>`` first, no ``<eos>``. Not replicated:
    ComfyUI's ``embedding:<name>`` textual-inversion syntax. Special-token strings in the text
    (e.g. ``<start_of_turn>``) become their token ids (transformers' behaviour; a plain
    SentencePiece encoder would spell them out character by character).

    Rows are left-padded with ``<pad>`` to the batch's longest prompt, not to ``max_length``:
    ComfyUI drops the padding after Gemma anyway. Left padding shifts the real tokens' RoPE
    positions (``position_ids`` are ``arange`` over the padded length, as in ComfyUI); RoPE is
    relative, so their hidden states change only by rounding, a few bf16 ulps in bf16
    (``tests/unit/test_gemma_tokenize.py`` checks it in fp32). Batched and one-at-a-time bf16
    encodes therefore agree to bf16 rounding, not bit for bit. The prompt encoder pads the rows
    further, to the length LTX-2's tokenizers pad to, so the positions are theirs
    (``PromptEncoder._padded`` in ``ltx_mgpu.text.encoder.prompt``).

    Args:
        tower: a loaded ``GemmaTextTower`` (only its ``tokenizer`` is used).
        prompts: one string per prompt, at least one; Unicode text (:func:`check_prompts`: the
            entry points check it, ``LocalTextEncoder.encode`` and the pool's ``encode``).
        max_length: the token budget per prompt, ``<bos>`` included (LTX-2: 1024).
        truncate: keep the first ``max_length`` tokens of a longer prompt (reporting the count
            dropped) instead of raising.

    Returns:
        ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (1 = real token), and
        the number of tokens dropped per prompt.

    Raises:
        ValueError: ``max_length < 1``.
        PromptTooLongError: ``truncate=False`` and a prompt exceeds ``max_length`` (names its index,
            token count and the budget).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    texts = [comfy_unescape(p) for p in prompts]
    encoded = tower.tokenizer(texts, add_special_tokens=True)["input_ids"]
    dropped = []
    for i, ids in enumerate(encoded):
        if len(ids) > max_length and not truncate:
            raise prompt_too_long(i, len(ids), max_length)
        dropped.append(max(0, len(ids) - max_length))
        encoded[i] = ids[:max_length]
    width = max(len(ids) for ids in encoded)
    pad = int(tower.tokenizer.pad_token_id)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, ids in enumerate(encoded):
        input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, width - len(ids) :] = 1
    return input_ids, attention_mask, dropped


def comfy_file_tokenizer(path: Path, spm_bytes: bytes | None) -> tuple[Any, tuple[Path, ...]]:
    """The embedded ``spiece_model`` if any, else a tokenizer beside the file; with its files."""
    if spm_bytes is not None:
        try:
            return tokenizer_from_spm(spm_bytes), ()
        except GemmaFormatError as exc:
            raise GemmaFormatError(f"{path}: embedded 'spiece_model': {exc}") from exc
    found = comfy_tokenizer_files(path)
    if found is None:
        raise no_tokenizer_error(path)
    return load_tokenizer(found), found.files
