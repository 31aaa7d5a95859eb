"""Retake the README's ComfyUI screenshots: ``docs/text_to_video_workflow.png`` and ``docs/panel.png``.

Run from the repository root with ComfyUI's interpreter (the environment of README "Use in
ComfyUI" > "Testing against a real ComfyUI"), with Chromium installed::

    COMFYUI_DIR=~/ComfyUI COMFYUI_PYTHON=~/comfy-venv/bin/python ~/comfy-venv/bin/python docs/screenshots.py

It starts ComfyUI headless on the CPU with this pack exactly as ``tests/comfyui/test_comfyui_real.py``
does, with the tiny models also linked under the names the shipped workflows use
(``ltx-2-19b-dev.safetensors``, ``gemma_3_12B_it.safetensors``), so the canvas shows the
workflow as a user with the real models sees it (no "missing model" marks). Headless Chromium
(``$CHROMIUM``, default ``/usr/bin/chromium``) is driven over the DevTools protocol at a
1600x1000 viewport:

1. ``app.loadGraphData`` loads ``workflows/ltx_mgpu_text_to_video.json``, the view is fitted,
   and the page is captured -> ``docs/text_to_video_workflow.png``.
2. The tiny text-to-video values (2 CPU ranks, 64x64, 9 frames, 5000 steps) are written into
   the loaded graph's widgets and queued from the page, so the canvas shows what runs; while the
   pool samples, the *LTX-2 GPUs* sidebar tab is opened and the top of the page (panel + running
   graph) is captured -> ``docs/panel.png``; then the prompt is interrupted.

Writes each PNG atomically (temp file + rename). Raises ``AssertionError`` with the reason when
ComfyUI or Chromium does not come up or the page never shows what is captured.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
WIDTH, HEIGHT = 1600, 1000

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


class Page:
    """One Chromium page over the DevTools protocol: ``call(method, params)`` -> result dict."""

    def __init__(self, ws):
        self.ws, self.counter, self.errors = ws, 0, []

    async def call(self, method: str, params: dict | None = None, timeout: float = 120.0) -> dict:
        self.counter += 1
        mid = self.counter
        await self.ws.send_json({"id": mid, "method": method, "params": params or {}})
        while True:
            msg = json.loads((await self.ws.receive(timeout=timeout)).data)
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(msg["params"]["exceptionDetails"])[:1000])
            elif msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method} failed: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expr: str):
        """The value of a JavaScript expression (promises awaited); raises on a thrown exception."""
        out = await self.call("Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in out:
            raise AssertionError(f"page script failed: {json.dumps(out['exceptionDetails'])[:2000]}")
        return out.get("result", {}).get("value")

    async def wait_for(self, expr: str, what: str, seconds: float = 120.0):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            value = await self.eval(expr)
            if value:
                return value
            await asyncio.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}")

    async def screenshot(self, path: Path, clip: dict | None = None) -> None:
        """Capture the viewport (or ``clip``: x, y, width, height in CSS pixels) to ``path`` atomically."""
        params = {"format": "png"}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        data = base64.b64decode((await self.call("Page.captureScreenshot", params))["data"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        print(f"wrote {path} ({len(data) // 1024} KiB)")


PREPARE = """(async () => {
  const s = app.extensionManager.setting;
  await s.set('Comfy.TutorialCompleted', true);
  await s.set('Comfy.Minimap.Visible', false);
  await s.set('Comfy.Graph.CanvasInfo', false);
  await s.set('LiteGraph.Canvas.MinFontSizeForLOD', 1);  // draw text at any zoom
  // zoom so that nodes `ids` (all when null) fill the canvas right of `left`, below `top` (centred when `middle`)
  window.__ltxFit = (ids, left, top, middle) => {
    const b = [Infinity, Infinity, -Infinity, -Infinity], T = LiteGraph.NODE_TITLE_HEIGHT;
    for (const n of app.graph._nodes) {
      if (ids && !ids.includes(n.id)) continue;
      b[0] = Math.min(b[0], n.pos[0]); b[1] = Math.min(b[1], n.pos[1] - T - 16);
      b[2] = Math.max(b[2], n.pos[0] + n.size[0]); b[3] = Math.max(b[3], n.pos[1] + n.size[1]);
    }
    const w = innerWidth - left - 40, h = innerHeight - top - 30, gw = b[2] - b[0], gh = b[3] - b[1];
    const s = Math.min(w / gw, h / gh, 1);
    app.canvas.ds.scale = s;
    const dy = middle ? (h / s - gh) / 2 : 0;
    app.canvas.ds.offset = [left / s - b[0] + (w / s - gw) / 2, top / s - b[1] + dy];
    app.canvas.setDirty(true, true);
    return {scale: s, bottom: top + (dy + gh) * s};
  };
  return true; })()"""
# A fresh user directory opens the templates browser once its list has loaded: close any dialog,
# then make sure none comes back within a second.
CLOSE_DIALOGS = """(async () => {
  let quiet = 0;
  for (let i = 0; i < 80 && quiet < 4; i++) {
    const d = document.querySelector('.p-dialog');
    if (d) {
      quiet = 0;
      const b = d.querySelector('.p-dialog-close-button');
      if (b) b.click(); else document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape', bubbles: true}));
    } else quiet++;
    await new Promise(r => setTimeout(r, 250));
  }
  return !document.querySelector('.p-dialog'); })()"""
LOAD = """(async () => {
  const wf = app.extensionManager.workflow;
  await app.loadGraphData(%s, true, true, 'ltx_mgpu_text_to_video');
  await new Promise(r => setTimeout(r, 1000));
  for (const other of wf.openWorkflows.filter(w => !w.path.endsWith('/ltx_mgpu_text_to_video.json')))
    await wf.closeWorkflow(other, {warnIfUnsaved: false});  // the default graph's tab
  await new Promise(r => setTimeout(r, 500));
  const fit = __ltxFit(null, 70, 110, true);
  await new Promise(r => setTimeout(r, 1000));
  return {fit, flagged: app.graph._nodes.filter(n => n.has_errors).map(n => n.type)}; })()"""
# The tiny prompt's widget values are written into the loaded graph, so the canvas shows what runs.
QUEUE = """(async () => {
  for (const [id, node] of Object.entries(%s)) {
    const n = app.graph.getNodeById(Number(id));
    for (const [name, value] of Object.entries(node.inputs)) {
      const w = Array.isArray(value) ? null : (n.widgets || []).find(w => w.name === name);
      if (w) w.value = value;
    }
  }
  app.canvas.setDirty(true, true);
  await app.queuePrompt(0, 1);
  const b = document.querySelector('.ltx-mgpu-status-tab-button');
  if (!b) return null;
  b.click();
  await new Promise(r => setTimeout(r, 500));
  const panel = document.querySelector('.ltx-mgpu-panel').getBoundingClientRect();
  return __ltxFit([1, 2, 3, 4, 10, 11], panel.right + 20, 150, false); })()"""
BUSY_WITH_RANKS = """(() => { const p = document.querySelector('.ltx-mgpu-panel .ltx-mgpu-pool[data-state="busy"]');
  const job = p && p.querySelector('.ltx-mgpu-job');
  return !!job && p.querySelectorAll('.ltx-mgpu-rank').length === 2 && /denois\\w* (\\d+)\\//.test(job.textContent)
    && Number(job.textContent.match(/denois\\w* (\\d+)\\//)[1]) >= 50; })()"""


async def take(ws_url: str) -> None:
    """Both screenshots from the ComfyUI page behind ``ws_url`` (see the module docstring)."""
    import aiohttp
    from comfyui_support import api_workflow, tiny_prompt

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        page = Page(ws)
        await page.call("Runtime.enable")
        await page.call("Emulation.setDeviceMetricsOverride",
                        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
        await page.wait_for("window.app && app.graph && window.ltxMgpu ? window.ltxMgpu.mode() : null",
                            "ComfyUI's page with our extension")
        await page.eval(PREPARE)
        workflow = (REPO / "workflows" / "ltx_mgpu_text_to_video.json").read_text()
        loaded = await page.eval(LOAD % workflow)
        assert not loaded["flagged"], f"nodes flagged with errors after loading the workflow: {loaded['flagged']}"
        assert await page.eval(CLOSE_DIALOGS), "a dialog covers the canvas and does not close"
        await page.screenshot(DOCS / "text_to_video_workflow.png")

        prompt = tiny_prompt(api_workflow("ltx_mgpu_text_to_video"), steps=5000)
        fit = await page.eval(QUEUE % json.dumps(prompt))
        assert fit, "the LTX-2 GPUs sidebar tab button is missing"
        await page.wait_for(BUSY_WITH_RANKS, "the panel showing the busy pool with 2 ranks", seconds=300)
        assert await page.eval(CLOSE_DIALOGS), "a dialog covers the page and does not close"
        await page.screenshot(DOCS / "panel.png", {"x": 0, "y": 0, "width": WIDTH,
                                                   "height": min(HEIGHT, int(fit["bottom"]) + 30)})
        await page.eval("app.api.interrupt()")
        ours = [e for e in page.errors if "ltx_mgpu" in e or "ltx-mgpu" in e]
        assert not ours, f"page errors from the pack: {ours}"


def main() -> None:
    comfy = os.environ.get("COMFYUI_DIR")
    assert comfy and (Path(comfy) / "main.py").is_file(), "set COMFYUI_DIR to a ComfyUI checkout"
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(chromium).exists(), "no Chromium (Debian: apt-get install chromium); set $CHROMIUM"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LTX_MGPU_HOME"] = tempfile.mkdtemp(prefix="ltxm-shots-home-")  # keep the user's cache out
    from comfyui_support import chromium_page, comfyui_server, workflow_model_links

    from ltx_mgpu.assets import tiny_gemma_comfy_file, tiny_gemma_dir, tiny_ltx_checkpoint

    assets = Path(tempfile.mkdtemp(prefix="ltxm-shots-assets-"))
    try:
        links = workflow_model_links(tiny_gemma_comfy_file(assets))
        with comfyui_server(tiny_gemma_dir(assets), tiny_ltx_checkpoint("2.3", assets), links=links) as srv, \
                chromium_page(srv.url, chromium, (WIDTH, HEIGHT)) as ws_url:
            asyncio.run(take(ws_url))
    finally:
        shutil.rmtree(assets, ignore_errors=True)
        shutil.rmtree(os.environ["LTX_MGPU_HOME"], ignore_errors=True)


if __name__ == "__main__":
    main()
