"""The pack imported as ComfyUI imports it, in a process where the pool cannot run (no fcntl, not
Linux): the nodes still load, and say why on use.
"""

from __future__ import annotations

import os
import subprocess
import sys

from nodes_support import REPO


def test_nodes_load_where_the_pool_cannot_run_and_say_why_on_use():
    script = f"""
import importlib.util, sys
import torch                         # (torch itself imported on the real platform)
sys.modules["fcntl"] = None          # as on Windows: the pool's runtime module cannot import
sys.platform = "win32"
spec = importlib.util.spec_from_file_location("pack", {str(REPO / '__init__.py')!r},
                                              submodule_search_locations=[{str(REPO)!r}])
pack = importlib.util.module_from_spec(spec); sys.modules["pack"] = pack; spec.loader.exec_module(pack)
print(len(pack.NODES))
for cls in pack.NODES.values():
    cls.define_schema()
try:
    pack.NODES["LTXMGPU_Pool"].execute("all", 1, "with-owner", True)
except RuntimeError as e:
    print("ERROR", e)
print(sys.modules["pack.nodes.routes"].status_payload()["message"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "8"
    assert lines[1].startswith("ERROR LTX-2 Multi-GPU: the multi-GPU pool runs on Linux only (this is win32)")
    assert "Linux only" in lines[2]
