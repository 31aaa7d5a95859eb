"""The README's "Try it without a GPU or the big models", in a real ComfyUI (headless, CPU): runs
only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md).

``python -m ltx_mgpu make-assets --comfyui ROOT`` is run (with this interpreter, ComfyUI's) into a
fresh ComfyUI root before ComfyUI starts on it. Then:

* the files are where the command said, under names that say what they are and what goes with
  what, and the command is idempotent (a second run rewrites nothing);
* ComfyUI's own pickers list them (``/object_info``), and ``LTXVAudioVAELoader`` reads the
  checkpoint's audio VAE whole (no "Missing VAE keys" line in ComfyUI's log);
* every shipped workflow, as the command's copy in ``user/default/workflows/ltx-mgpu-test/``
  holds it (the shipped API twin with the same pickers, :func:`tiny_api_workflow`; the copies
  are checked to be the shipped UI files with only those pickers changed), runs to success on
  the Pool's ``gpus: all``, which is CPU ranks here, at the workflow's own sizes and steps;
  each saved video holds the workflow's frame count and an audio track;
* headless Chromium: ComfyUI's frontend lists the copies in its user workflows, loads each with
  no unknown node, and converts it into exactly the API workflow run above.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_support import (  # noqa: E402
    NEEDS_COMFYUI_REASON,
    REPO,
    api_workflow,
    cdp_page,
    chromium_page,
    comfyui_server,
    has_comfyui,
    http,
    run_prompt,
    wait_for,
)

from ltx_mgpu.assets.comfyui import (  # noqa: E402
    PREFIX,
    WORKFLOW_FOLDER,
    shipped_workflows,
    tiny_api_workflow,
    tiny_ui_workflow,
)

pytestmark = [pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON)]

WORKFLOWS = tuple(p.stem for p in shipped_workflows())


def _make_assets(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ltx_mgpu", "make-assets", "--comfyui", str(root)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def installed(tiny_gemma_dir, tiny_ltx_23):
    pytest.importorskip("aiohttp", reason="the /ws client needs aiohttp (a ComfyUI requirement)")
    runs = {}

    def prepare(root: Path) -> None:
        runs["first"] = _make_assets(root)
        runs["files"] = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and PREFIX in str(p)}
        runs["second"] = _make_assets(root)
        runs["root"] = root

    with comfyui_server(tiny_gemma_dir, tiny_ltx_23, prepare=prepare) as srv:
        yield srv, runs


def _picks(runs) -> dict[str, str]:
    root = runs["root"]
    (ckpt,) = (root / "models" / "checkpoints").glob(f"{PREFIX}_*.safetensors")
    (gemma,) = (root / "models" / "text_encoders").glob(f"{PREFIX}_*")
    return {"checkpoint": ckpt.name, "gemma": f"{gemma.name}/", "projection": f"checkpoints/{ckpt.name}"}


def test_the_command_installs_named_pairs_and_workflows_idempotently(installed):
    srv, runs = installed
    first, second = runs["first"], runs["second"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    picks = _picks(runs)
    ckpt, gemma = picks["checkpoint"], picks["gemma"].rstrip("/")
    label = ckpt.removeprefix(f"{PREFIX}_tiny-ltx-2.3_for-").removesuffix(".safetensors")
    assert label in ("gemma-3-270m", "tiny-gemma-3") and gemma == f"{PREFIX}_{label}_for-tiny-ltx-2.3"
    assert f"checkpoint: {runs['root'] / 'models' / 'checkpoints' / ckpt}" in first.stdout
    for name in WORKFLOWS:
        assert f"workflow:   {runs['root'] / WORKFLOW_FOLDER / name}.json" in first.stdout
    after = {p: p.stat().st_mtime_ns for p in runs["files"] if "workflows" not in p.parts}
    assert after == {p: t for p, t in runs["files"].items() if "workflows" not in p.parts}  # models not rewritten
    for path in shipped_workflows():  # the copies: the shipped files with only the model pickers changed
        copy = json.loads((runs["root"] / WORKFLOW_FOLDER / path.name).read_text())
        assert copy == tiny_ui_workflow(json.loads(path.read_text()), picks), path.name


def test_comfyui_lists_the_files_and_reads_the_whole_audio_vae(installed):
    srv, runs = installed
    picks = _picks(runs)
    _, info = http(f"{srv.url}/object_info")
    assert picks["checkpoint"] in info["LTXMGPU_ModelLoader"]["input"]["required"]["ckpt_name"][1]["options"]
    assert picks["checkpoint"] in info["LTXVAudioVAELoader"]["input"]["required"]["ckpt_name"][1]["options"]
    gemma_input = info["LTXMGPU_GemmaLoader"]["input"]["required"]
    assert picks["gemma"] in gemma_input["gemma"][1]["options"]
    assert picks["projection"] in gemma_input["projection"][1]["options"]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_shipped_workflow_runs_on_the_tiny_models(installed, name):
    srv, runs = installed
    prompt = tiny_api_workflow(api_workflow(name), _picks(runs))
    prompt_id, messages = asyncio.run(run_prompt(srv, prompt, timeout=1800))
    errors = [m for m in messages if m["type"] in ("execution_error", "execution_interrupted")]
    assert not errors, f"{json.dumps(errors)[:4000]}\n{srv.log_tail()}"
    _, history = http(f"{srv.url}/history/{prompt_id}")
    entry = history[prompt_id]
    assert entry["status"]["status_str"] == "success"
    av = pytest.importorskip("av")
    for node_id, node in prompt.items():
        if node["class_type"] != "SaveVideo":
            continue
        length = next(n["inputs"]["length"] for n in prompt.values() if n["class_type"] == "EmptyLTXVLatentVideo")
        for f in entry["outputs"][node_id]["images"]:
            with av.open(str(srv.output / f["subfolder"] / f["filename"])) as container:
                assert container.streams.audio, f"{f['filename']}: no audio track"
                assert sum(1 for _ in container.decode(video=0)) == length
    assert "Missing VAE keys" not in srv.log.read_text(errors="replace")


LOAD_AND_CONVERT = """(async () => {
  const listed = await (await fetch('/api/userdata?dir=workflows&recurse=true')).json();
  await app.loadGraphData(%s, true, true, %s);
  await new Promise(r => setTimeout(r, 500));
  const nodes = app.graph._nodes;
  const api = {};
  for (const [id, node] of Object.entries((await app.graphToPrompt()).output))
    api[id] = {class_type: node.class_type, inputs: node.inputs};
  return {listed, api, unknown: nodes.filter(n => !LiteGraph.registered_node_types[n.type]).map(n => n.type)}; })()"""


def test_the_frontend_lists_the_copies_and_converts_each_to_what_ran(installed):
    srv, runs = installed
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("no Chromium (Debian: apt-get install chromium); set $CHROMIUM to its path")
    picks = _picks(runs)

    def load(name):
        async def step(evaluate):
            text = (runs["root"] / WORKFLOW_FOLDER / f"{name}.json").read_text()
            return await evaluate(LOAD_AND_CONVERT % (text, json.dumps(name)))
        return step

    async def ready(evaluate):
        return await wait_for(evaluate, "window.app && app.graph ? true : null", "ComfyUI's page")

    with chromium_page(srv.url, chromium) as ws_url:
        results, _ = asyncio.run(cdp_page(ws_url, [ready] + [load(n) for n in WORKFLOWS]))
    for name, got in zip(WORKFLOWS, results[1:]):
        assert f"{PREFIX}/{name}.json" in got["listed"], got["listed"]
        assert not got["unknown"], (name, got["unknown"])
        want = tiny_api_workflow(api_workflow(name), picks)
        assert got["api"] == {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in want.items()}, name


def test_browse_templates_gets_thumbnails_the_display_name_and_official_downloads(installed):
    """What Browse Templates and the missing-models dialog read for this pack: each workflow's
    ``.jpg`` beside it, the group's title through ComfyUI's i18n (``locales/``), and each
    ``properties.models`` entry equal to the one ComfyUI's own LTX-2 templates give that file."""
    import urllib.request

    srv, _ = installed
    for name in WORKFLOWS:
        with urllib.request.urlopen(f"{srv.url}/api/workflow_templates/ltx-mgpu/{name}.jpg", timeout=30) as r:
            assert r.status == 200 and r.read(3) == b"\xff\xd8\xff", name
    _, i18n = http(f"{srv.url}/i18n")
    assert i18n["en"]["templateWorkflows"]["category"]["ltx-mgpu"] == "LTX-2 Multi-GPU"

    official = {}

    def collect(value):
        if isinstance(value, dict):
            for m in value.get("models") or []:
                if isinstance(m, dict) and "name" in m:
                    official.setdefault(m["name"], (m.get("url"), m.get("directory")))
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)

    import importlib.util

    for package in ("comfyui_workflow_templates_media_video", "comfyui_workflow_templates_media_image"):
        spec = importlib.util.find_spec(package)
        if spec is None:
            continue
        for template in Path(spec.origin).parent.glob("templates/*ltx2*.json"):
            collect(json.loads(template.read_text()))
    if not official:
        pytest.skip("ComfyUI's workflow template packages are not installed here")
    for path in shipped_workflows():
        for node in json.loads(path.read_text())["nodes"]:
            for m in node.get("properties", {}).get("models", []):
                assert (m["url"], m["directory"]) == official[m["name"]], (path.name, m)
