"""Compiled blocks across processes (``ltx_mgpu.denoise.compiling``): a first process compiles
a small model's blocks on CPU (Inductor) and saves the artifacts; a second, fresh process loads
them and its first call at the size hits torch's caches (its counters say so, no timing). The
second process runs without the first one's Inductor directory, so only the saved artifact file
(``torch.compiler.load_cache_artifacts``) can give the hit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from ltx_mgpu.denoise.compiling import CompileCache, CompileWatch, graph_key
from ltx_mgpu.denoise.fp8 import compile_blocks

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
    def forward(self, x):
        return x + torch.nn.functional.gelu(self.lin(x))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(Block() for _ in range(2))
    def forward(self, x):
        for b in self.transformer_blocks:
            x = b(x)
        return x

torch.manual_seed(0)
model = Model().eval()
logs = []
compile_blocks(model, dynamic=False)
cache = CompileCache.open(graph_key(model, "cpu"), log=lambda text, level: logs.append(text))
loaded = cache.load_all()
watch = CompileWatch(model, cache)
watch.on_compile = lambda text, cached: logs.append(text)
x = torch.randn(1, int(sys.argv[1]), 32, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    y = model(x)
    eager = x
    for b in model.transformer_blocks:
        eager = eager + torch.nn.functional.gelu(b.lin(eager))
print("RESULT " + json.dumps({"loaded": loaded, "logs": logs, "err": float((y - eager).abs().max()),
                              "counters": {k: dict(v) for k, v in counters.items()}}))
"""


def run_child(tokens: int, cache_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LTX_MGPU_COMPILE_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("LTX_MGPU_COMPILE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_fresh_process_loads_the_saved_compile_and_hits_the_cache(tmp_path):
    cache_dir = tmp_path / "compile"
    first = run_child(48, cache_dir)
    assert first["loaded"] == 0
    assert first["logs"][0] == ("compiling the transformer blocks for 48 video tokens, first time at this size: "
                                "up to a minute")
    assert first["logs"][1].startswith(f"compile cache: saved {cache_dir / 'artifacts'}")
    assert first["counters"]["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert first["counters"]["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert first["err"] <= 1e-5
    saved = list((cache_dir / "artifacts").glob("*.bin"))
    assert len(saved) == 1 and (saved[0].stat().st_mode & 0o777) == 0o600

    shutil.rmtree(cache_dir / "inductor")  # only the artifact file is left to hit
    second = run_child(48, cache_dir)
    assert second["loaded"] == 1
    assert re.fullmatch(rf"compile cache: loaded {re.escape(str(saved[0]))} \(\d+\.\d MiB\)", second["logs"][0])
    assert second["logs"][1] == ("compiling the transformer blocks for 48 video tokens, from the compile cache: "
                                 "a few seconds")
    assert second["counters"]["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["counters"]["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    assert second["err"] <= 1e-5
    assert len(second["logs"]) == 2  # a size it had: nothing saved again
