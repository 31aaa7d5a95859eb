"""The Gemma 3 sources users have: format detection, source files, content identity, config.

Formats (:data:`SUPPORTED_FORMATS`):

* ``"hf_snapshot"``: a Hugging Face snapshot directory (``config.json`` + ``*.safetensors``), in
  the multimodal layout of ``Gemma3ForConditionalGeneration`` (``language_model.model.*`` or
  ``model.language_model.*``) or the text-only ``Gemma3ForCausalLM`` layout (``model.*``).
* ``"comfy_file"``: ComfyUI's single-file Gemma 3 (``models/text_encoders/gemma_3_12B_it*.safetensors``):
  text keys ``model.layers.N.*`` in bf16, fp16 or fp32, or quantized layer by layer as ComfyUI
  stores them (``gemma_3_12B_it_fp4_mixed``: nvfp4 layers beside plain ones; ``fp8_scaled``;
  int8, with or without ConvRot; :mod:`ltx_mgpu.quantized.layers` reads the markers), the
  SentencePiece tokenizer embedded as a uint8 tensor ``spiece_model`` (or a tokenizer beside it).
  :func:`comfy_file_quant` checks every text tensor's storage from the header and the markers, so
  a file ltx_mgpu cannot read is refused before anything is loaded.
* ``"gguf_file"``: a Gemma 3 GGUF file (llama.cpp's layout, e.g. unsloth's
  ``gemma-3-12b-it-Q4_K_M.gguf``; ``general.architecture`` ``gemma3``), its vocabulary embedded
  or a tokenizer beside it as for a ComfyUI file; read by ``ltx_mgpu.text.gemma.gguf_file``.
* ``"nf4_artifact"``: an ltx_mgpu NF4 artifact directory (``ltx_mgpu_nf4.json``); detected here,
  loaded by ``ltx_mgpu.text.nf4.quantize``. The manifest is written last, so a directory with NF4 shards
  but no manifest (an interrupted quantization) is rejected with a message saying so.

Everything here reads only file names, ``config.json``, safetensors headers and ComfyUI's small
per-layer quantization markers, never weights: the prompt cache keys on :func:`gemma_identity`
before any model is loaded. The identity covers how the weights are decoded: a ComfyUI file with
quantized layers adds their formats and the dequantization's version
(``ltx_mgpu.quantized.dequant.DECODER``) to its digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from safetensors import safe_open

from ltx_mgpu.files import json_metadata, safetensors_header
from ltx_mgpu.identity import file_digest
from ltx_mgpu.quantized.dequant import describe_decoding
from ltx_mgpu.quantized.ggml import DECODER, GGMLFormatError, open_gguf
from ltx_mgpu.quantized.ggml import READABLE as GGML_READABLE
from ltx_mgpu.quantized.layers import AUX_SUFFIXES, READABLE, FileQuant, QuantFormatError, read_file_quant

__all__ = [
    "SUPPORTED_FORMATS",
    "GemmaFormatError",
    "GemmaWeightsError",
    "TokenizerFiles",
    "detect_gemma_format",
    "comfy_file_quant",
    "find_tokenizer_files",
    "comfy_tokenizer_files",
    "gemma_source_files",
    "gemma_identity",
    "source_identity",
    "gemma3_text_config",
    "comfy_text_config",
]

SUPPORTED_FORMATS = (
    "Supported Gemma 3 formats: (1) a Hugging Face snapshot directory with config.json and *.safetensors "
    "weights, in the multimodal (Gemma3ForConditionalGeneration) or text-only (Gemma3ForCausalLM) key layout; "
    "(2) a ComfyUI single-file Gemma 3 text encoder .safetensors with model.layers.* keys: bf16, fp16 or fp32 "
    "weights, or ComfyUI's quantized layers (nvfp4, float8_e4m3fn / e5m2, int8_tensorwise with or without ConvRot), "
    "e.g. gemma_3_12B_it.safetensors, gemma_3_12B_it_fp8_scaled.safetensors, gemma_3_12B_it_fp4_mixed.safetensors; "
    "(3) a Gemma 3 GGUF file (llama.cpp's layout, e.g. gemma-3-12b-it-Q4_K_M.gguf; F16, BF16, Q8_0, Q6_K, Q5_K, "
    "Q5_0/1, Q4_K, Q4_0/1, Q3_K, Q2_K); (4) an ltx_mgpu NF4 artifact directory (ltx_mgpu_nf4.json)."
)
#: What to use instead of a ComfyUI file whose storage cannot be read.
_READABLE_FILES = ("; use ComfyUI's gemma_3_12B_it.safetensors (bf16), gemma_3_12B_it_fp8_scaled.safetensors or "
                   "gemma_3_12B_it_fp4_mixed.safetensors, or a Hugging Face snapshot of Gemma 3")
_PLAIN_DTYPES = ("BF16", "F16", "F32")
NF4_MANIFEST = "ltx_mgpu_nf4.json"
#: Name prefix of the temporary directory an NF4 artifact is built in (``ltx_mgpu.text.nf4.artifact``).
NF4_PARTIAL_PREFIX = ".nf4-partial-"
#: Safetensors header key where our tiny ComfyUI files store the text config (JSON).
COMFY_CONFIG_METADATA_KEY = "ltx_mgpu_gemma_config"
#: The files of a transformers tokenizer directory that define its behaviour.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class GemmaFormatError(ValueError):
    """The path is not a supported Gemma 3 source; the message names the supported formats."""


class GemmaWeightsError(ValueError):
    """A Gemma 3 source's weights do not match its config (missing / unexpected / mis-shaped keys)."""


# --------------------------------------------------------------------------- detection


def safetensors_keys(path: Path) -> tuple[list[str], dict[str, str]]:
    """Tensor names and header metadata of a ``.safetensors`` file (the header only is read).

    Raises:
        GemmaFormatError: the file is not readable as safetensors.
    """
    return safetensors_header(path, GemmaFormatError, f". {SUPPORTED_FORMATS}")


def _detect_directory(p: Path) -> str:
    if (p / NF4_MANIFEST).is_file():
        return "nf4_artifact"
    has_config = (p / "config.json").is_file()
    if has_config and any(p.glob("*.safetensors")):
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
    if p.name.startswith(NF4_PARTIAL_PREFIX) or any(p.glob("nf4-*.safetensors")):
        raise GemmaFormatError(
            f"{p}: an incomplete ltx_mgpu NF4 artifact (no {NF4_MANIFEST}, which quantize-nf4 writes last): the "
            "quantization was interrupted or is still running. Delete it and run again: "
            f"python -m ltx_mgpu quantize-nf4 SOURCE OUT_DIR. {SUPPORTED_FORMATS}"
        )
    if has_config and (any(p.glob("*.bin")) or any(p.glob("*.pt"))):
        reason = "its weights are pickle files (.bin/.pt), which ltx_mgpu never loads; use a safetensors snapshot"
    elif not any(p.iterdir()):
        reason = "the directory is empty"
    else:
        reason = "it has no config.json + *.safetensors pair and no " + NF4_MANIFEST
    raise GemmaFormatError(f"{p}: not a Gemma 3 source: {reason}. {SUPPORTED_FORMATS}")


def detect_gemma_format(path: str | os.PathLike) -> str:
    """Classify a Gemma 3 source: ``"hf_snapshot"``, ``"comfy_file"``, ``"gguf_file"`` or
    ``"nf4_artifact"``.

    Only file names, ``config.json``, safetensors and GGUF headers are read (no weights).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: anything else (message lists :data:`SUPPORTED_FORMATS`).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Gemma 3 source not found: {p}")
    if p.is_dir():
        return _detect_directory(p)
    if p.suffix.lower() == ".gguf":
        try:
            f = open_gguf(p)
        except GGMLFormatError as e:
            raise GemmaFormatError(f"{e}. {SUPPORTED_FORMATS}") from None
        arch = f.architecture
        if arch != "gemma3":
            hint = " (an LTX-2 transformer: load it with the Model Loader)" if arch in ("ltxv", "ltxav") else ""
            raise GemmaFormatError(f"{p}: a GGUF file of architecture {arch!r}{hint}, not Gemma 3 ('gemma3'). "
                                   f"{SUPPORTED_FORMATS}")
        unread = next(((t.name, t.qtype) for t in f.tensors.values() if t.qtype not in GGML_READABLE), None)
        if unread is not None:
            raise GemmaFormatError(f"{p}: tensor {unread[0]} is {unread[1]}, which ltx_mgpu does not read (it reads "
                                   f"{', '.join(GGML_READABLE)}); use a GGUF of one of those types (Q8_0, Q6_K, "
                                   "Q5_K_M, Q4_K_M...)")
        return "gguf_file"
    if p.suffix != ".safetensors":
        raise GemmaFormatError(f"{p}: unsupported file type {p.suffix or '(no suffix)'!r}. {SUPPORTED_FORMATS}")
    keys, _ = safetensors_keys(p)
    key_set = set(keys)
    if "model.embed_tokens.weight" in key_set and "model.layers.0.self_attn.q_norm.weight" in key_set:
        comfy_file_quant(p)  # refuses a storage that cannot be read, before anything is loaded
        return "comfy_file"
    if any(k.startswith(("language_model.model.", "model.language_model.")) for k in keys):
        hint = "it looks like one shard of a Hugging Face snapshot: pass the snapshot directory instead"
    else:
        hint = (
            "no Gemma 3 text keys (model.embed_tokens.weight, model.layers.0.self_attn.q_norm.weight); "
            f"first keys: {sorted(keys)[:5]}"
        )
    raise GemmaFormatError(f"{p}: {hint}. {SUPPORTED_FORMATS}")


def comfy_file_quant(path: str | os.PathLike) -> FileQuant:
    """The quantized text-tower layers of a ComfyUI file (``model.*``), every other text tensor
    checked to be bf16, fp16 or fp32. Reads the header and the ``comfy_quant`` markers only.

    Raises:
        GemmaFormatError: a text layer in a format ltx_mgpu cannot read (the message names the
            layer, the format and what to use instead), a damaged marker or scale, or a text
            tensor stored in another dtype without a marker.
    """
    p = Path(path)
    try:
        quant = read_file_quant(p, prefix="model.", hint=_READABLE_FILES)
    except QuantFormatError as exc:
        raise GemmaFormatError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors for a bad file
        raise GemmaFormatError(f"{p}: not a readable .safetensors file ({exc}). {SUPPORTED_FORMATS}") from None
    with safe_open(str(p), framework="pt", device="cpu") as f:
        for key in sorted(f.keys()):
            if not key.startswith("model.") or key.endswith(AUX_SUFFIXES) or quant.of(key) is not None:
                continue
            kind = f.get_slice(key).get_dtype()
            if kind not in _PLAIN_DTYPES:
                raise GemmaFormatError(
                    f"{p}: tensor {key} is stored as {kind} without a ComfyUI comfy_quant marker saying how to read "
                    f"it; ltx_mgpu reads bf16, fp16 and fp32 tensors, fp8 weights, and the quantized layers "
                    f"ComfyUI marks ({', '.join(READABLE)}){_READABLE_FILES}"
                )
    return quant


# --------------------------------------------------------------------------- tokenizer files


@dataclass(frozen=True)
class TokenizerFiles:
    """Where a Gemma tokenizer lives (``ltx_mgpu.text.gemma.tokenizer.load_tokenizer`` builds it).

    Attributes:
        kind: ``"sentencepiece"`` (``tokenizer.model``, converted by transformers) or
            ``"tokenizers"`` (``tokenizer.json`` and its config files, read by transformers).
        directory: the directory holding the files.
        files: the files whose bytes define the tokenizer (part of the source's identity).
    """

    kind: Literal["sentencepiece", "tokenizers"]
    directory: Path
    files: tuple[Path, ...]


def find_tokenizer_files(d: Path, prefer_spm: bool = False) -> TokenizerFiles | None:
    """The tokenizer in directory ``d``: ``tokenizer.json`` first, or ``tokenizer.model`` first
    when ``prefer_spm``; None when ``d`` has neither."""
    spm = TokenizerFiles("sentencepiece", d, (d / "tokenizer.model",))
    fast = TokenizerFiles("tokenizers", d, tuple(d / n for n in _TOKENIZER_FILES if (d / n).is_file()))
    order = (spm, fast) if prefer_spm else (fast, spm)
    main_file = {"sentencepiece": "tokenizer.model", "tokenizers": "tokenizer.json"}
    return next((t for t in order if (d / main_file[t.kind]).is_file()), None)


def comfy_tokenizer_files(path: Path) -> TokenizerFiles | None:
    """A tokenizer beside a ComfyUI file without ``spiece_model``: in ``<dir>/<stem>/``, else
    ``<dir>/``; SentencePiece ``tokenizer.model`` preferred (ComfyUI's own choice)."""
    for d in (path.parent / path.stem, path.parent):
        if d.is_dir() and (found := find_tokenizer_files(d, prefer_spm=True)) is not None:
            return found
    return None


def no_tokenizer_error(path: Path) -> GemmaFormatError:
    """The error for a source without a tokenizer, naming where one is looked for."""
    if path.is_dir():
        return GemmaFormatError(f"{path}: no tokenizer.json or tokenizer.model; copy Gemma 3's tokenizer files in")
    if path.suffix.lower() == ".gguf":
        return GemmaFormatError(
            f"{path}: no tokenizer: the GGUF has no vocabulary (tokenizer.ggml.tokens) and there is no "
            f"tokenizer.model or tokenizer.json in {path.parent / path.stem} or {path.parent}. Place Gemma 3's "
            "tokenizer.model beside it.")
    return GemmaFormatError(
        f"{path}: no tokenizer: the file has no embedded 'spiece_model' tensor and there is no tokenizer.model "
        f"or tokenizer.json in {path.parent / path.stem} or {path.parent}. "
        "Use ComfyUI's Gemma 3 file (tokenizer embedded) or place Gemma 3's tokenizer.model beside it."
    )


# --------------------------------------------------------------------------- identity


def gemma_source_files(path: str | os.PathLike) -> tuple[Path, ...]:
    """The files whose bytes determine a Gemma source's outputs (weights, config, tokenizer).

    HF snapshot: ``config.json``, every ``*.safetensors``, the tokenizer files; ComfyUI or GGUF
    file: the file (plus the tokenizer beside it when none is embedded); NF4 artifact: every file
    in it. Reads only names and headers.

    Raises:
        FileNotFoundError, GemmaFormatError: as :func:`detect_gemma_format`, or no tokenizer.
    """
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact":
        return tuple(sorted(f for f in p.rglob("*") if f.is_file()))
    if fmt == "hf_snapshot":
        found = find_tokenizer_files(p)
        if found is None:
            raise no_tokenizer_error(p)
        return (p / "config.json", *sorted(p.glob("*.safetensors")), *found.files)
    if fmt == "gguf_file":
        if open_gguf(p).has_field("tokenizer.ggml.tokens"):
            return (p,)
    elif "spiece_model" in safetensors_keys(p)[0]:
        return (p,)
    found = comfy_tokenizer_files(p)
    if found is None:
        raise no_tokenizer_error(p)
    return (p, *found.files)


def gemma_source_listing(path: str | os.PathLike) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """``(files, directories)``: :func:`gemma_source_files`, and the directories whose listings
    decided them (the snapshot or artifact directory and every directory under an artifact; for
    a ComfyUI file, its directory and ``<dir>/<stem>/``, present or not, where a tokenizer
    would be looked for first). Adding, removing or renaming anything that could change the
    files changes one of these directories' mtimes (``identity.memoized_by_stats``).

    Raises:
        FileNotFoundError, GemmaFormatError: as :func:`gemma_source_files`.
    """
    p = Path(path)
    files = gemma_source_files(p)
    if p.is_dir():
        dirs = (p, *sorted(d for d in p.rglob("*") if d.is_dir())) if (p / NF4_MANIFEST).is_file() else (p,)
    else:
        dirs = (p.parent, p.parent / p.stem)
    return files, dirs


def source_identity(source: Path, files: Sequence[Path]) -> str:
    """SHA-256 hex over ``(role, file_digest)`` pairs: the role is the path inside a source
    directory, or ``"<weights>"`` / the tokenizer's file name for a single file, so renaming or
    moving a source keeps its identity while any byte change alters it. A ComfyUI file with
    quantized layers adds ``("<decoding>", ltx_mgpu.quantized.dequant.describe_decoding(...))``
    and a GGUF file ``("<decoding>", ltx_mgpu.quantized.ggml.DECODER)``: the formats and the
    dequantization's version, so a change of how they are decoded never
    serves an embedding of the old weights (files without quantized layers keep their digest).

    Raises:
        ValueError: ``files`` is empty (a tower built in memory has no content identity).
        GemmaFormatError: as :func:`comfy_file_quant`.
    """
    if not files:
        raise ValueError("no source files to digest (a tower built in memory has no content identity)")
    h = hashlib.sha256(b"ltx_mgpu.gemma.v1\n")
    roles = []
    for f in files:
        role = os.path.relpath(f, source) if source.is_dir() else ("<weights>" if f == source else f.name)
        roles.append((role, file_digest(f)))
    if source.suffix == ".safetensors" and source.is_file():
        decoding = describe_decoding(comfy_file_quant(source))
        if decoding:
            roles.append(("<decoding>", decoding))
    elif source.suffix.lower() == ".gguf" and source.is_file():
        roles.append(("<decoding>", DECODER))
    for role, digest in sorted(roles):
        h.update(f"{role}\0{digest}\n".encode())
    return h.hexdigest()


def gemma_identity(path: str | os.PathLike) -> str:
    """Content identity (SHA-256 hex) of a Gemma source, without loading it: the digest of
    :func:`gemma_source_files` (memoised per file by ``ltx_mgpu.identity``). Equals the loaded
    tower's ``GemmaTextTower.identity``; copies of the same bytes at another path agree."""
    return source_identity(Path(path), gemma_source_files(path))


# --------------------------------------------------------------------------- config


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

    Defaults are Gemma 3 12B's (google/gemma-3-12b-it ``config.json``, and ComfyUI's
    ``Gemma3_12B_Config`` in ``comfy/text_encoders/llama.py``): sliding window
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


def _shape_config(shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, int]:
    """The Gemma 3 dimensions the text tower's tensor shapes give (``Gemma3TextConfig`` names)."""
    vocab, hidden = shapes["model.embed_tokens.weight"]
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
    try:
        heads = shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim
        kv_heads = shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim
        intermediate = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    except KeyError as exc:
        raise GemmaFormatError(f"{path}: missing {exc}, needed to infer the Gemma 3 config. "
                               f"{SUPPORTED_FORMATS}") from exc
    return {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": max(layer_ids) + 1,
            "head_dim": head_dim, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate}


def comfy_text_config(meta: dict[str, str], shapes: dict[str, tuple[int, ...]], path: Path) -> Any:
    """The ``Gemma3TextConfig`` of a ComfyUI single file.

    From our header metadata (``ltx_mgpu_gemma_config``) when present, else inferred from tensor
    shapes plus Gemma 3 12B defaults (:func:`gemma3_text_config`): vocab/hidden from
    ``embed_tokens``, layers by count, head_dim from ``q_norm``, heads and KV heads from
    ``q_proj``/``k_proj`` rows / head_dim, intermediate from ``gate_proj``. A stored config must
    agree with those shapes.

    Args:
        meta: the safetensors header metadata.
        shapes: ``model.*`` tensor name -> shape.
        path: the file, for error messages.

    Raises:
        GemmaFormatError: a tensor needed for the inference is missing; the stored config is
            over ``ltx_mgpu.files.MAX_JSON_METADATA`` bytes, not a JSON object, or not a Gemma 3
            text config.
        GemmaWeightsError: the stored config contradicts the tensors' shapes (names the field).
    """
    from transformers import Gemma3TextConfig

    hint = "; export the file again (ltx_mgpu.assets.gemma) or remove the metadata entry"
    stored = json_metadata(meta, COMFY_CONFIG_METADATA_KEY, str(path), GemmaFormatError, hint)
    dims = _shape_config(shapes, path)
    if stored is None:
        return gemma3_text_config(dims["vocab_size"], dims["hidden_size"], dims["intermediate_size"],
                                  dims["num_hidden_layers"], dims["num_attention_heads"],
                                  dims["num_key_value_heads"], dims["head_dim"])
    try:
        cfg = Gemma3TextConfig.from_dict(stored)
    except Exception as e:  # noqa: BLE001 - transformers' validation raises several types for a bad field
        raise GemmaFormatError(f"{path}: the '{COMFY_CONFIG_METADATA_KEY}' metadata does not describe a Gemma 3 text "
                               f"model ({type(e).__name__}: {str(e).splitlines()[0][:160]}){hint}") from None
    for field, value in dims.items():
        if getattr(cfg, field, None) != value:
            raise GemmaWeightsError(f"{path}: the '{COMFY_CONFIG_METADATA_KEY}' metadata says {field} "
                                   f"{getattr(cfg, field, None)!r:.40}, the weights {value}: the header does not "
                                   f"describe these weights{hint}")
    return cfg
