"""Load the Gemma 3 *text tower* for LTX-2 text encoding, from the formats users have.

Only ``Gemma3TextModel`` is built: no vision tower, no multimodal projector, no ``lm_head``
(LTX-2 consumes hidden states only). Sources:

* ``"hf_snapshot"``: a Hugging Face snapshot directory (``config.json`` + ``*.safetensors``), in
  the multimodal layout of ``Gemma3ForConditionalGeneration`` (``language_model.model.*`` or
  ``model.language_model.*``) or the text-only ``Gemma3ForCausalLM`` layout (``model.*``).
* ``"comfy_file"``: ComfyUI's single-file Gemma 3 (``models/text_encoders/gemma_3_12B_it*.safetensors``):
  text keys ``model.layers.N.*`` (bf16, fp16, or fp8-e4m3 with optional per-tensor scales), the
  SentencePiece tokenizer embedded as a uint8 tensor ``spiece_model``.
* ``"nf4_artifact"``: an ltx_mgpu NF4 artifact directory (``ltx_mgpu_nf4.json``); detected here,
  loaded by ``ltx_mgpu.text.nf4``.

Both bf16 sources go through transformers' own ``from_pretrained`` loader (meta-device init,
weights assigned, RoPE ``inv_freq`` buffers computed in fp32), and every load is checked for
missing text-tower keys: ``Gemma3TextModel.from_pretrained(<multimodal dir>)`` otherwise
*silently* initialises random weights (../shared/notes/gemma-nf4.md §3.2).

Tokenization follows ComfyUI (``comfy/text_encoders/lt.py``, ``Gemma3_12BTokenizer``): raw text,
no chat template, BOS prepended, no EOS, left padding with ``<pad>`` (0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ltx_mgpu.identity import file_digest

__all__ = [
    "GemmaFormatError",
    "GemmaWeightsError",
    "PromptTooLongError",
    "GemmaTextTower",
    "detect_gemma_format",
    "load_gemma_text_tower",
    "tokenize",
    "encode_hidden_states",
    "gemma_identity",
    "gemma_source_files",
    "gemma3_text_config",
    "compile_text_tower",
    "tokenizer_from_spm",
    "parse_spm_model",
    "SpmModel",
    "SUPPORTED_FORMATS",
]

SUPPORTED_FORMATS = (
    "Supported Gemma 3 formats: (1) a Hugging Face snapshot directory with config.json and *.safetensors "
    "weights, in the multimodal (Gemma3ForConditionalGeneration) or text-only (Gemma3ForCausalLM) key layout; "
    "(2) a ComfyUI single-file Gemma 3 text encoder .safetensors with model.layers.* keys (bf16, fp16 or fp8 "
    "e4m3 weights), e.g. gemma_3_12B_it.safetensors; (3) an ltx_mgpu NF4 artifact directory (ltx_mgpu_nf4.json)."
)
NF4_MANIFEST = "ltx_mgpu_nf4.json"
#: Safetensors header key where our tiny ComfyUI files store the text config (JSON).
COMFY_CONFIG_METADATA_KEY = "ltx_mgpu_gemma_config"
#: Multimodal / text-only prefixes stripped to reach Gemma3TextModel keys (gemma-nf4.md §3.2).
_SNAPSHOT_KEY_MAPPING = {r"^(?:language_model\.model|model\.language_model|model)\.": ""}
_TEXT_KEY = re.compile(r"^(?:layers\.\d+\.|embed_tokens\.|norm\.)")
_COMFY_AUX_SUFFIXES = (".weight_scale", ".scale_weight", ".input_scale", ".scale_input", ".comfy_quant")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class GemmaFormatError(ValueError):
    """The path is not a supported Gemma 3 source; the message names the supported formats."""


class GemmaWeightsError(ValueError):
    """A Gemma 3 source's weights do not match its config (missing / unexpected / mis-shaped keys)."""


class PromptTooLongError(ValueError):
    """A prompt exceeds the token budget and truncation was not allowed."""


@dataclass
class GemmaTextTower:
    """A loaded Gemma 3 text tower and its tokenizer.

    Attributes:
        model: ``Gemma3TextModel`` in eval mode (weights in the requested dtype, RoPE buffers fp32).
        tokenizer: HF tokenizer: left padding, ``<bos>`` prepended, no ``<eos>``.
        config: the ``Gemma3TextConfig``.
        format: ``"hf_snapshot"`` or ``"comfy_file"``.
        path: the source path as given.
        files: the files whose bytes define the outputs (weights, config, tokenizer).
    """

    model: Any
    tokenizer: Any
    config: Any
    format: str
    path: Path
    files: tuple[Path, ...] = field(default=())

    @functools.cached_property
    def identity(self) -> str:
        """Content identity of the source (see :func:`gemma_identity`); computed on first use."""
        return _source_identity(Path(self.path), self.files)

    @property
    def num_hidden_states(self) -> int:
        """``L = num_hidden_layers + 1`` (embedding output + one per decoder layer); 49 for 12B."""
        return int(self.config.num_hidden_layers) + 1

    @property
    def hidden_size(self) -> int:
        """Hidden width ``D`` (3840 for Gemma 3 12B)."""
        return int(self.config.hidden_size)


# --------------------------------------------------------------------------- SentencePiece


def _pb_fields(buf: bytes):
    """Yield ``(field_number, value)`` of a protobuf message (varint -> int, bytes, fixed32 -> bytes)."""
    i, n = 0, len(buf)

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            if i >= n:
                raise ValueError("truncated varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return result

    while i < n:
        key = varint()
        fnum, wire = key >> 3, key & 7
        if wire == 0:
            yield fnum, varint()
        elif wire == 2:
            size = varint()
            if i + size > n:
                raise ValueError("truncated field")
            yield fnum, buf[i : i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield fnum, buf[i : i + width]
            i += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


@dataclass(frozen=True)
class SpmModel:
    """The parts of a SentencePiece ``ModelProto`` a Gemma tokenizer depends on.

    Field numbers: ``sentencepiece_model.proto`` (google/sentencepiece). ``pieces`` holds
    ``(piece, score, type)`` with type 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    6 byte.
    """

    pieces: tuple[tuple[str, float, int], ...]
    model_type: int = 1
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def parse_spm_model(data: bytes) -> SpmModel:
    """Parse a serialized SentencePiece model without ``protobuf`` (a minimal wire-format reader).

    Raises:
        GemmaFormatError: the bytes are not a SentencePiece model.
    """
    import struct

    def signed(v: int) -> int:
        return v - (1 << 64) if v >= 1 << 63 else v

    try:
        pieces, trainer, norm = [], {}, {}
        for fnum, value in _pb_fields(bytes(data)):
            if fnum == 1:
                piece = {1: b"", 2: b"\0\0\0\0", 3: 1}
                piece.update(dict(_pb_fields(value)))
                pieces.append((piece[1].decode("utf-8"), struct.unpack("<f", piece[2])[0], int(piece[3])))
            elif fnum == 2:
                trainer = dict(_pb_fields(value))
            elif fnum == 3:
                norm = dict(_pb_fields(value))
    except (ValueError, TypeError, AttributeError, struct.error, UnicodeDecodeError) as exc:
        raise GemmaFormatError(f"not a SentencePiece model ({exc})") from exc
    if not pieces:
        raise GemmaFormatError("not a SentencePiece model (no pieces)")
    index = {p: i for i, (p, _, _) in enumerate(pieces)}

    def special(id_field: int, default_id: int, piece_field: int, default_piece: bytes) -> int:
        # SentencePiece resolves <unk>/<bos>/<eos>/<pad> by piece name; a negative id disables it
        if signed(trainer.get(id_field, default_id)) < 0:
            return -1
        return index.get(bytes(trainer.get(piece_field, default_piece)).decode("utf-8", "replace"), -1)

    return SpmModel(
        pieces=tuple(pieces),
        model_type=int(trainer.get(3, 1)),
        byte_fallback=bool(trainer.get(35, 0)),
        unk_id=special(40, 0, 45, b"<unk>"),
        bos_id=special(41, 1, 46, b"<s>"),
        eos_id=special(42, 2, 47, b"</s>"),
        pad_id=special(43, -1, 48, b"<pad>"),
        normalizer_name=bytes(norm.get(1, b"")).decode("utf-8", "replace"),
        precompiled_charsmap=bytes(norm.get(2, b"")),
        add_dummy_prefix=bool(norm.get(3, 1)),
        remove_extra_whitespaces=bool(norm.get(4, 1)),
        escape_whitespaces=bool(norm.get(5, 1)),
    )


def tokenizer_from_spm(data: bytes) -> Any:
    """A transformers ``GemmaTokenizer`` equivalent to a Gemma SentencePiece model.

    Builds the BPE vocabulary and the merges (ordered by the merged piece's score, as
    SentencePiece's BPE encoder picks the highest-scoring pair first; transformers
    ``generate_merges``) from the model's pieces; control pieces become special tokens,
    user-defined pieces plain added tokens. Configured like Gemma 3: left padding, ``<bos>``
    prepended, no ``<eos>``. Needs neither ``protobuf`` nor network access.

    Raises:
        GemmaFormatError: not a Gemma-style SentencePiece model (BPE, byte fallback, identity
            normalisation, no dummy prefix, whitespace kept and escaped to ``▁``).
    """
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    spm = parse_spm_model(data)
    gemma_like = (
        spm.model_type == 2
        and spm.byte_fallback
        and not spm.add_dummy_prefix
        and not spm.remove_extra_whitespaces
        and spm.escape_whitespaces
        and not spm.precompiled_charsmap
    )
    if not gemma_like or min(spm.unk_id, spm.bos_id, spm.pad_id) < 0:
        raise GemmaFormatError(
            "the SentencePiece model is not a Gemma tokenizer (expected BPE with byte fallback, identity "
            "normalisation, no dummy prefix, whitespace escaped, <unk>, <bos> and <pad> defined); use Gemma 3's "
            "tokenizer.model"
        )
    names = [p for p, _, _ in spm.pieces]
    vocab = {p: i for i, p in enumerate(names)}
    scores = {p: s for p, s, t in spm.pieces if t == 1}
    skip = {p for p, _, t in spm.pieces if t != 1}
    merges = generate_merges(vocab, scores, skip_tokens=skip)
    control = [AddedToken(p, special=True, normalized=False) for p, _, t in spm.pieces if t == 3]
    user = [AddedToken(p, special=False, normalized=False) for p, _, t in spm.pieces if t == 4]
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=names[spm.unk_id],
        bos_token=names[spm.bos_id],
        eos_token=names[spm.eos_id] if spm.eos_id >= 0 else None,
        pad_token=names[spm.pad_id],
        mask_token=AddedToken("<mask>", special=True, normalized=False) if "<mask>" in vocab else None,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
    )
    named = {str(t) for t in (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token, tok.mask_token) if t}
    extra = [t for t in control if t.content not in named]
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    if user:
        tok.add_tokens(user)
    return tok


# --------------------------------------------------------------------------- detection


def _safetensors_keys(path: Path) -> tuple[list[str], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise GemmaFormatError(f"{path}: not a readable .safetensors file ({exc}). {SUPPORTED_FORMATS}") from exc


def detect_gemma_format(path: str | os.PathLike) -> str:
    """Classify a Gemma 3 source: ``"hf_snapshot"``, ``"comfy_file"`` or ``"nf4_artifact"``.

    Only file names, ``config.json`` and safetensors headers are read (no weights).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: anything else (message lists :data:`SUPPORTED_FORMATS`).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Gemma 3 source not found: {p}")
    if p.is_dir():
        if (p / NF4_MANIFEST).is_file():
            return "nf4_artifact"
        has_config = (p / "config.json").is_file()
        has_st = any(p.glob("*.safetensors"))
        if has_config and has_st:
            try:
                model_type = json.loads((p / "config.json").read_text(encoding="utf-8")).get("model_type")
            except (OSError, ValueError) as exc:
                raise GemmaFormatError(f"{p}/config.json is unreadable ({exc}). {SUPPORTED_FORMATS}") from exc
            if model_type not in ("gemma3", "gemma3_text"):
                raise GemmaFormatError(
                    f"{p}: config.json has model_type {model_type!r}, not a Gemma 3 model "
                    f"('gemma3' or 'gemma3_text'). {SUPPORTED_FORMATS}"
                )
            return "hf_snapshot"
        if has_config and (any(p.glob("*.bin")) or any(p.glob("*.pt"))):
            reason = "its weights are pickle files (.bin/.pt), which ltx_mgpu never loads; use a safetensors snapshot"
        elif not any(p.iterdir()):
            reason = "the directory is empty"
        else:
            reason = "it has no config.json + *.safetensors pair and no " + NF4_MANIFEST
        raise GemmaFormatError(f"{p}: not a Gemma 3 source: {reason}. {SUPPORTED_FORMATS}")
    if p.suffix != ".safetensors":
        raise GemmaFormatError(f"{p}: unsupported file type {p.suffix or '(no suffix)'!r}. {SUPPORTED_FORMATS}")
    keys, _ = _safetensors_keys(p)
    key_set = set(keys)
    if "model.embed_tokens.weight" in key_set and "model.layers.0.self_attn.q_norm.weight" in key_set:
        return "comfy_file"
    if any(k.startswith(("language_model.model.", "model.language_model.")) for k in keys):
        hint = "it looks like one shard of a Hugging Face snapshot: pass the snapshot directory instead"
    else:
        hint = (
            "no Gemma 3 text keys (model.embed_tokens.weight, model.layers.0.self_attn.q_norm.weight); "
            f"first keys: {sorted(keys)[:5]}"
        )
    raise GemmaFormatError(f"{p}: {hint}. {SUPPORTED_FORMATS}")


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _without_load_report():
    """Drop transformers' "LOAD REPORT" warning: the vision keys it lists as unexpected are skipped on
    purpose, and missing keys are raised by :func:`_check_loading_info` instead."""
    logger = logging.getLogger("transformers.modeling_utils")

    def keep(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _check_loading_info(info: dict, source: Path) -> None:
    """Raise unless every text-tower weight came from the checkpoint (no silent random init)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    stray = sorted(k for k in (info.get("unexpected_keys") or []) if _TEXT_KEY.match(k))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing text-tower weight(s): {missing[:20]}")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) with a shape not matching the config: {mismatched[:20]}")
    if stray:
        problems.append(f"{len(stray)} text-tower weight(s) the config has no place for: {stray[:20]}")
    if problems:
        raise GemmaWeightsError(
            f"{source}: the Gemma 3 text-tower weights do not match the config: " + "; ".join(problems)
            + ". The file is incomplete or belongs to another model; re-download or re-export it."
        )


def _check_tokenizer(tok: Any, source: Path) -> Any:
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


def _find_tokenizer(d: Path, prefer_spm: bool = False) -> tuple[Callable[[], Any], tuple[Path, ...]] | None:
    """Locate a tokenizer in ``d``: ``tokenizer.json`` (transformers' own loader) or
    ``tokenizer.model`` (SentencePiece, converted by :func:`tokenizer_from_spm`); ``prefer_spm``
    tries the latter first. Returns ``(build, files)`` or None when ``d`` has neither."""
    spm_file, json_file, cfg_file = d / "tokenizer.model", d / "tokenizer.json", d / "tokenizer_config.json"

    def from_spm() -> Any:
        return tokenizer_from_spm(spm_file.read_bytes())

    def from_json() -> Any:
        from transformers import AutoTokenizer

        # without tokenizer_config.json, name Gemma's special tokens (else no <bos>/<pad>)
        names = {} if cfg_file.is_file() else dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
        return AutoTokenizer.from_pretrained(str(d), padding_side="left", add_bos_token=True, add_eos_token=False, **names)

    json_files = tuple(d / n for n in _TOKENIZER_FILES if (d / n).is_file())
    order = [(spm_file, from_spm, (spm_file,)), (json_file, from_json, json_files)]
    for path, build, files in order if prefer_spm else order[::-1]:
        if path.is_file():
            return build, files
    return None


def _comfy_tokenizer_location(path: Path) -> tuple[Callable[[], Any], tuple[Path, ...]] | None:
    """A tokenizer beside a ComfyUI file without ``spiece_model``: in ``<dir>/<stem>/``, else ``<dir>/``."""
    for d in (path.parent / path.stem, path.parent):
        if d.is_dir() and (found := _find_tokenizer(d, prefer_spm=True)) is not None:
            return found
    return None


def _no_tokenizer(path: Path) -> GemmaFormatError:
    if path.is_dir():
        return GemmaFormatError(f"{path}: no tokenizer.json or tokenizer.model; copy Gemma 3's tokenizer files in")
    return GemmaFormatError(
        f"{path}: no tokenizer: the file has no embedded 'spiece_model' tensor and there is no tokenizer.model "
        f"or tokenizer.json in {path.parent / path.stem} or {path.parent}. "
        "Use ComfyUI's Gemma 3 file (tokenizer embedded) or place Gemma 3's tokenizer.model beside it."
    )


def gemma_source_files(path: str | os.PathLike) -> tuple[Path, ...]:
    """The files whose bytes determine a Gemma source's outputs (weights, config, tokenizer).

    HF snapshot: ``config.json``, every ``*.safetensors``, the tokenizer files; ComfyUI file: the
    file (plus the tokenizer beside it when none is embedded); NF4 artifact: every file in it.
    Reads only names and safetensors headers.

    Raises:
        FileNotFoundError, GemmaFormatError: as :func:`detect_gemma_format`, or no tokenizer.
    """
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact":
        return tuple(sorted(f for f in p.rglob("*") if f.is_file()))
    if fmt == "hf_snapshot":
        found = _find_tokenizer(p)
        if found is None:
            raise _no_tokenizer(p)
        return (p / "config.json", *sorted(p.glob("*.safetensors")), *found[1])
    keys, _ = _safetensors_keys(p)
    if "spiece_model" in keys:
        return (p,)
    found = _comfy_tokenizer_location(p)
    if found is None:
        raise _no_tokenizer(p)
    return (p, *found[1])


def _source_identity(source: Path, files: Sequence[Path]) -> str:
    """SHA-256 over ``(role, file_digest)`` pairs: the role is the path inside a source directory,
    or ``"<weights>"`` / the tokenizer's file name for a single file, so renaming or moving a
    source keeps its identity while any byte change alters it."""
    if not files:
        raise ValueError("no source files to digest (a tower built in memory has no content identity)")
    h = hashlib.sha256(b"ltx_mgpu.gemma.v1\n")
    roles = []
    for f in files:
        role = os.path.relpath(f, source) if source.is_dir() else ("<weights>" if f == source else f.name)
        roles.append((role, file_digest(f)))
    for role, digest in sorted(roles):
        h.update(f"{role}\0{digest}\n".encode())
    return h.hexdigest()


def gemma_identity(path: str | os.PathLike) -> str:
    """Content identity (SHA-256 hex) of a Gemma source, without loading it: the digest of
    :func:`gemma_source_files` (memoised per file by ``ltx_mgpu.identity``). Equals the loaded
    tower's :attr:`GemmaTextTower.identity`; copies of the same bytes at another path agree."""
    return _source_identity(Path(path), gemma_source_files(path))


def _load_snapshot(d: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    from transformers import AutoConfig, Gemma3TextModel

    cfg = AutoConfig.from_pretrained(str(d))
    text_cfg = cfg.text_config if cfg.model_type == "gemma3" else cfg
    with _without_load_report():
        model, info = Gemma3TextModel.from_pretrained(
            str(d),
            config=text_cfg,
            key_mapping=_SNAPSHOT_KEY_MAPPING,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map={"": device},
            use_safetensors=True,
            ignore_mismatched_sizes=True,  # reported in the loading info, raised by _check_loading_info
            output_loading_info=True,
        )
    _check_loading_info(info, d)
    found = _find_tokenizer(d)
    if found is None:
        raise _no_tokenizer(d)
    build, tok_files = found
    files = (d / "config.json", *sorted(d.glob("*.safetensors")), *tok_files)
    return GemmaTextTower(model.eval(), _check_tokenizer(build(), d), text_cfg, "hf_snapshot", d, files)


class _ScaledFp8:
    """Lazy fp8 -> fp32 dequantisation of one safetensors slice: ``w.float() * scale``.

    Exposes ``[...]`` like a safetensors slice, which is all transformers' loader uses.
    """

    def __init__(self, slice_: Any, scale: torch.Tensor | None):
        self._slice, self._scale = slice_, scale

    def __getitem__(self, index: Any) -> torch.Tensor:
        w = self._slice[...].to(torch.float32)
        if self._scale is not None:
            w = w * self._scale.to(torch.float32)
        return w[index]


def gemma3_text_config(
    vocab: int = 262208,
    hidden: int = 3840,
    intermediate: int = 15360,
    layers: int = 48,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 256,
    **overrides: Any,
) -> Any:
    """A ``Gemma3TextConfig`` with the given dimensions and Gemma 3 12B's other settings.

    Defaults are Gemma 3 12B's (google/gemma-3-12b-it ``config.json``, quoted in
    ../shared/notes/gemma-nf4.md §3.4-3.5, and ComfyUI's ``Gemma3_12B_Config``): sliding window
    1024, 5 sliding + 1 global layers, RoPE theta 1e6 with linear scaling factor 8 on global
    layers and theta 1e4 on sliding ones, RMSNorm eps 1e-6, ``query_pre_attn_scalar`` = head_dim
    (256 for 12B; ComfyUI scales attention by head_dim), pad 0 / bos 2 / eos [1, 106].
    ``overrides`` are passed to ``Gemma3TextConfig`` last.
    """
    from transformers import Gemma3TextConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=1024,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, 106],
    )
    kwargs.update(overrides)
    return Gemma3TextConfig(**kwargs)


def _comfy_text_config(meta: dict[str, str], shapes: dict[str, tuple[int, ...]], path: Path) -> Any:
    """``Gemma3TextConfig`` from our metadata, else inferred from shapes + Gemma 3 12B defaults
    (:func:`gemma3_text_config`): vocab/hidden from ``embed_tokens``, layers by count, head_dim
    from ``q_norm``, heads and KV heads from ``q_proj``/``k_proj`` rows / head_dim, intermediate
    from ``gate_proj``."""
    from transformers import Gemma3TextConfig

    if COMFY_CONFIG_METADATA_KEY in meta:
        return Gemma3TextConfig.from_dict(json.loads(meta[COMFY_CONFIG_METADATA_KEY]))
    vocab, hidden = shapes["model.embed_tokens.weight"]
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    n_layers = max(layer_ids) + 1
    head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
    try:
        heads = shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim
        kv_heads = shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim
        intermediate = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    except KeyError as exc:
        raise GemmaFormatError(f"{path}: missing {exc}, needed to infer the Gemma 3 config. {SUPPORTED_FORMATS}") from exc
    return gemma3_text_config(vocab, hidden, intermediate, n_layers, heads, kv_heads, head_dim)


def _comfy_tokenizer(path: Path, spm_bytes: bytes | None) -> tuple[Any, tuple[Path, ...]]:
    if spm_bytes is not None:
        return tokenizer_from_spm(spm_bytes), ()
    found = _comfy_tokenizer_location(path)
    if found is None:
        raise _no_tokenizer(path)
    return found[0](), found[1]


def _load_comfy(path: Path, device: Any, dtype: torch.dtype, attn_implementation: str) -> GemmaTextTower:
    from safetensors import safe_open
    from transformers import Gemma3TextModel

    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        meta = dict(f.metadata() or {})
        spm_bytes = f.get_tensor("spiece_model").numpy().tobytes() if "spiece_model" in keys else None
        state: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for key in sorted(keys):
            if not key.startswith("model.") or key.endswith(_COMFY_AUX_SUFFIXES):
                continue
            sl = f.get_slice(key)
            shapes[key] = tuple(sl.get_shape())
            kind = sl.get_dtype()
            if kind in ("F8_E4M3", "F8_E5M2"):
                base = key[: -len(".weight")] if key.endswith(".weight") else key
                scale_key = next((k for k in (base + ".weight_scale", base + ".scale_weight") if k in keys), None)
                sl = _ScaledFp8(sl, f.get_tensor(scale_key) if scale_key else None)
            elif kind not in ("BF16", "F16", "F32"):
                raise GemmaFormatError(
                    f"{path}: tensor {key} is stored as {kind}; quantized ComfyUI formats other than fp8 e4m3 "
                    "(e.g. nvfp4 'fp4_mixed', int8) are not supported. Use the bf16, fp16 or fp8 Gemma 3 file."
                )
            state[key[len("model.") :]] = sl
        cfg = _comfy_text_config(meta, shapes, path)
        with _without_load_report():
            model, info = Gemma3TextModel.from_pretrained(
                None,
                config=cfg,
                state_dict=state,
                dtype=dtype,
                attn_implementation=attn_implementation,
                device_map={"": device},
                ignore_mismatched_sizes=True,
                output_loading_info=True,
            )
    _check_loading_info(info, path)
    tok, tok_files = _comfy_tokenizer(path, spm_bytes)
    return GemmaTextTower(model.eval(), _check_tokenizer(tok, path), cfg, "comfy_file", path, (path, *tok_files))


def load_gemma_text_tower(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    weights: str = "bf16",
) -> GemmaTextTower:
    """Load only the Gemma 3 text tower (``Gemma3TextModel``) and its tokenizer.

    Args:
        path: an HF snapshot directory or a ComfyUI single-file ``.safetensors`` (see module doc).
        device: where the weights are placed.
        dtype: weight dtype; fp16/fp8 source weights are upcast to it (fp8 times its scale).
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        weights: ``"bf16"`` (plain weights in ``dtype``). ``"nf4"`` belongs to ``ltx_mgpu.text.nf4``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: unsupported source, quantization or tokenizer (names the supported formats).
        GemmaWeightsError: text-tower weights missing, mis-shaped or unexpected for the config.
        NotImplementedError: ``weights="nf4"`` or an NF4 artifact (not handled by this loader).
        ValueError: ``weights`` is neither ``"bf16"`` nor ``"nf4"``.
    """
    if weights not in ("bf16", "nf4"):
        raise ValueError(f"weights must be 'bf16' or 'nf4', got {weights!r}")
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact" or weights == "nf4":
        raise NotImplementedError(
            f"{p}: NF4 weights (an ltx_mgpu NF4 artifact, or weights='nf4') are not loaded by this bf16 loader; "
            "NF4 loading is provided by ltx_mgpu.text.nf4. Use weights='bf16' with the bf16 source for now."
        )
    load = _load_snapshot if fmt == "hf_snapshot" else _load_comfy
    return load(p, torch.device(device), dtype, attn_implementation)


def compile_text_tower(tower: GemmaTextTower, **compile_kwargs: Any) -> GemmaTextTower:
    """A copy of ``tower`` whose model is ``torch.compile(tower.model, **compile_kwargs)``.

    The original tower is left untouched (same weights, shared); ``encode_hidden_states`` works
    on either. ``compile_kwargs`` go to ``torch.compile`` (e.g. ``mode``, ``dynamic``, ``backend``).
    """
    return dataclasses.replace(tower, model=torch.compile(tower.model, **compile_kwargs))


# --------------------------------------------------------------------------- tokenize / encode


def _comfy_unescape(text: str) -> str:
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
    relative, so their hidden states change only by rounding: <= 1e-5 in fp32, a few bf16 ulps
    in bf16 (measured on the tiny model; tests/test_gemma.py). Batched and one-at-a-time bf16
    encodes therefore agree to bf16 rounding, not bit for bit.

    Args:
        prompts: one string per prompt.
        max_length: the token budget per prompt, ``<bos>`` included (LTX-2: 1024).
        truncate: keep the first ``max_length`` tokens of a longer prompt (reporting the count
            dropped) instead of raising.

    Returns:
        ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (1 = real token), and
        the number of tokens dropped per prompt.

    Raises:
        ValueError: no prompts, a non-string prompt, or ``max_length < 1``.
        PromptTooLongError: ``truncate=False`` and a prompt exceeds ``max_length`` (names its index,
            token count and the budget).
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if any(not isinstance(p, str) for p in prompts):
        raise ValueError(f"every prompt must be a str, got {[type(p).__name__ for p in prompts]}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    texts = [_comfy_unescape(p) for p in prompts]
    encoded = tower.tokenizer(texts, add_special_tokens=True)["input_ids"]
    dropped = []
    for i, ids in enumerate(encoded):
        if len(ids) > max_length and not truncate:
            raise PromptTooLongError(
                f"prompt {i} has {len(ids)} tokens (BOS included), over the budget of {max_length}; "
                "shorten it or allow truncation"
            )
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


def encode_hidden_states(
    tower: GemmaTextTower, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Run the text tower and return all ``L = num_hidden_layers + 1`` hidden states.

    Args:
        input_ids: ``[B, T]`` int64 token ids (as from :func:`tokenize`).
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding.

    Returns:
        ``L`` tensors ``[B, T, D]`` in the model's dtype on its device: index 0 is the scaled
        embedding output (``embed * sqrt(D)``), indices 1..L-2 the raw decoder-layer outputs, and
        index L-1 the last layer's output *after* the final RMSNorm (transformers'
        ``hidden_states`` convention, which ComfyUI's ``intermediate_output="all"`` matches).
        Values at padded positions are meaningless; callers mask or trim them.

    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    device = tower.model.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = tower.model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            output_hidden_states=True,
            use_cache=False,
        )
    return tuple(out.hidden_states)
