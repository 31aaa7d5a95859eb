"""``quantize-nf4`` onto a real full disk (a small tmpfs, mounted as root): one line, nothing
left behind. The same with the full disk faked, as any user: ``tests/unit/test_nf4.py``."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to mount a small tmpfs (the test above fakes the full disk)")
def test_quantize_onto_a_real_full_tmpfs_says_so_in_one_line(tiny_gemma_dir, tmp_path, monkeypatch, capsys):
    """The same on a real 64 KiB tmpfs, safetensors' own write failing (the size check is told
    the disk is large enough, so the writes themselves meet the full disk)."""
    from ltx_mgpu.cli.main import main
    from ltx_mgpu.text.nf4 import artifact

    disk = tmp_path / "tmpfs"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        monkeypatch.setattr(artifact, "estimated_bytes", lambda expected: 1)
        rc = main(["quantize-nf4", str(tiny_gemma_dir), str(disk / "nf4"), "--device", "cpu"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(lines) == 1 and lines[0].startswith(f"error: no space left on {disk}: "), lines
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
