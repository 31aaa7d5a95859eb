"""``python -m ltx_mgpu encode`` as a user runs it (a process of its own): the embedded default, then
cache hits; every mistake named without a traceback. The encoder in one process:
``tests/unit/test_encoder.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from ltx_mgpu.text.embedding_files import load_embeddings

REPO = Path(__file__).resolve().parents[2]


def test_cli_encode_embedded_default_then_cache_hits(tmp_path):
    env = {"LTX_MGPU_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "emb.safetensors"
    cmd = [sys.executable, "-m", "ltx_mgpu", "encode", "--prompt", "a red fox", "--prompt", "a lighthouse",
           "--embedded-gemma", "tiny", "--out", str(out)]
    r1 = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r1.returncode == 0, r1.stderr
    assert "embedded default" in r1.stderr
    assert "0 cached, 2 encoded" in r1.stdout
    prompts, embs = load_embeddings(out)
    assert prompts == ["a red fox", "a lighthouse"] and embs[0].version == "2.3"
    r2 = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert "2 cached, 0 encoded" in r2.stdout
    _, embs2 = load_embeddings(out)
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(embs, embs2))
    bad = subprocess.run([sys.executable, "-m", "ltx_mgpu", "encode", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--prompt" in bad.stderr


def test_cli_encode_names_each_mistake_without_a_traceback(tmp_path, tiny_gemma_dir):
    """What a newcomer gets wrong: a file that is not safetensors, a device this torch cannot use,
    --gemma without --projection, a prompts file that is missing, a directory or empty, the 270M
    asked for with the 2.0 layout; and a long prompt: one clean note when it is truncated, an error
    with --no-truncate even when the truncated embedding is already cached."""
    env = {"LTX_MGPU_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = str(tmp_path / "emb.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 64)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "afile").write_text("")

    def encode(*args):
        cmd = [sys.executable, "-m", "ltx_mgpu", "encode", "--embedded-gemma", "tiny", "--out", out, *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    for args, message in [
        (("--prompt", "x", "--gemma", str(tiny_gemma_dir), "--projection", str(broken)),
         "broken.safetensors: not a readable .safetensors file"),
        (("--prompt", "x", "--device", "gpu0"), "--device gpu0: not a device; use cpu, cuda or cuda:N"),
        (("--prompt", "x", "--gemma", str(tiny_gemma_dir)), "--gemma was given without --projection"),
        (("--prompts-file", str(tmp_path / "nope.txt")), "--prompts-file " + str(tmp_path / "nope.txt") + ": no such"),
        (("--prompts-file", str(tmp_path)), ": a directory; give a text file with one prompt per line"),
        (("--prompts-file", str(broken.with_name("empty.txt"))), "holds no prompt: write one prompt per line"),
        (("--embedded-version", "2.0", "--prompt", "x", "--embedded-gemma", "gemma-270m"),
         "the embedded Gemma 3 270M pairs with the LTX-2.3 layout, not 2.0"),
        (("--prompt", "x", "--out", str(tmp_path / "afile" / "e.safetensors")), "afile is a file, not a directory"),
        (("--prompt", "x", "--out", str(tmp_path)), "is a directory; give a file name inside it"),
        (("--prompt", "x", "--out", str(tmp_path / "e.pt")), "give a name ending in .safetensors"),
    ] + ([] if torch.cuda.is_available() else
         [(("--prompt", "x", "--device", "cuda"), "--device cuda: torch sees no CUDA GPU here")]):
        r = encode(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    nested = tmp_path / "new" / "dir" / "e.safetensors"  # missing directories are made, as generate makes them
    r = encode("--prompt", "x", "--out", str(nested))
    assert r.returncode == 0 and nested.is_file(), r.stderr
    long_prompt = " ".join(["snow"] * 1500)
    r = encode("--prompt", long_prompt)
    assert r.returncode == 0, r.stderr
    assert "note: prompt 0 is longer than the 1024-token budget: its last" in r.stderr
    assert "UserWarning" not in r.stderr
    r = encode("--prompt", long_prompt, "--no-truncate")  # cached, truncated: still refused
    assert r.returncode == 2 and "over the budget of 1024" in r.stderr, r.stderr
