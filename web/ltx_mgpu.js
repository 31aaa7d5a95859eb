// LTX-2 Multi-GPU: ComfyUI frontend extension.
// - A sidebar tab (app.extensionManager.registerSidebarTab; a floating panel on frontends
//   without it) showing each pool's state, current job and a memory bar per rank, from
//   GET /ltx_mgpu/status; refreshed every 0.5 s while a job runs, every 10 s otherwise, and only
//   while visible; also at once (at most every 0.25 s) when ComfyUI reports a node starting, a
//   progress step or our nodes' phase text, so it keeps pace with ComfyUI's own progress bar.
//   A Free button posts /ltx_mgpu/free.
// - Pool Status / Free / Prompt Batch Encode nodes show their report on the node.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { renderPanel } from "./ltx_mgpu_panel.js";

const TAB_ID = "ltx-mgpu-status";
const FAST_MS = 500;
const SOON_MS = 250;
const SLOW_MS = 10000;
const TEXT_NODES = new Set(["LTXMGPU_PoolStatus", "LTXMGPU_Free", "LTXMGPU_PromptBatchEncode"]);

const state = { mode: null, views: new Set(), last: null, timer: null, due: 0, running: false, executing: false };

function addStylesheet() {
  if (document.getElementById("ltx-mgpu-css")) return;
  const link = document.createElement("link");
  link.id = "ltx-mgpu-css";
  link.rel = "stylesheet";
  link.href = new URL("./ltx_mgpu.css", import.meta.url).href;
  document.head.append(link);
}

async function fetchStatus() {
  try {
    const res = await api.fetchApi("/ltx_mgpu/status", { cache: "no-store" });
    if (!res.ok) return { available: false, message: `the status route answered HTTP ${res.status}` };
    return await res.json();
  } catch (e) {
    return { available: false, message: `ComfyUI's server is not reachable (${e && e.message ? e.message : e})` };
  }
}

async function freePools(button) {
  button.disabled = true;
  button.textContent = "Freeing…";
  try {
    await api.fetchApi("/ltx_mgpu/free", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ stop: false }),
    });
  } catch (e) {
    // the next refresh shows the server state
  }
  schedule(0);
}

function visible(el) {
  return el.isConnected && el.getClientRects().length > 0;
}

async function tick() {
  state.timer = null;
  for (const v of [...state.views]) if (!v.isConnected) state.views.delete(v);
  const shown = [...state.views].filter(visible);
  if (!shown.length) {
    if (state.views.size) schedule(SLOW_MS);
    return;
  }
  if (state.running) return;
  state.running = true;
  let busy = false;
  try {
    state.last = await fetchStatus();
    for (const v of shown) busy = renderPanel(v, state.last, freePools).busy || busy;
  } finally {
    state.running = false;
  }
  schedule(busy || state.executing ? FAST_MS : SLOW_MS);
}

function schedule(ms) {
  if (state.timer !== null) clearTimeout(state.timer);
  state.due = Date.now() + ms;
  state.timer = setTimeout(tick, ms);
}

/** Refresh within SOON_MS (an event says something changed), unless a refresh is due sooner. */
function soon() {
  if (state.timer === null || state.due - Date.now() > SOON_MS) schedule(SOON_MS);
}

function mount(el) {
  const body = document.createElement("div");
  el.replaceChildren(body);
  state.views.add(body);
  renderPanel(body, state.last, freePools);
  schedule(0);
  return body;
}

function floatingPanel() {
  const box = document.createElement("div");
  box.className = "ltx-mgpu-floating";
  const toggle = document.createElement("button");
  toggle.className = "ltx-mgpu-toggle";
  toggle.textContent = "LTX-2 GPUs";
  toggle.title = "LTX-2 Multi-GPU pool: state and memory per GPU";
  const content = document.createElement("div");
  content.className = "ltx-mgpu-floating-body";
  content.hidden = true;
  toggle.addEventListener("click", () => {
    content.hidden = !content.hidden;
    if (!content.hidden) schedule(0);
  });
  box.append(toggle, content);
  document.body.append(box);
  mount(content);
}

function showText(node, text) {
  const value = Array.isArray(text) ? text.join("\n") : text;
  if (typeof value !== "string") return;
  if (!node.__ltxMgpuText) {
    const area = document.createElement("textarea");
    area.readOnly = true;
    area.className = "ltx-mgpu-report";
    if (typeof node.addDOMWidget === "function") {
      const widget = node.addDOMWidget("ltx_mgpu_report", "ltx_mgpu_report", area, { serialize: false });
      if (widget) widget.serialize = false;
    }
    node.__ltxMgpuText = area;
  }
  node.__ltxMgpuText.value = value;
}

app.registerExtension({
  name: "ltx_mgpu.panel",
  setup() {
    addStylesheet();
    const em = app.extensionManager;
    if (em && typeof em.registerSidebarTab === "function") {
      em.registerSidebarTab({
        id: TAB_ID,
        icon: "pi pi-server",
        title: "LTX-2 GPUs",
        tooltip: "LTX-2 Multi-GPU pool: state and memory per GPU",
        type: "custom",
        render: (el) => {
          mount(el);
        },
      });
      state.mode = "sidebar";
    } else {
      floatingPanel();
      state.mode = "floating";
    }
    api.addEventListener("execution_start", () => {
      state.executing = true;
      schedule(0);
    });
    for (const ev of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(ev, () => {
        state.executing = false;
        schedule(0);
      });
    }
    api.addEventListener("executing", (e) => {
      state.executing = e.detail !== null && e.detail !== undefined;
      soon();
    });
    for (const ev of ["progress", "progress_text"]) api.addEventListener(ev, () => state.executing && soon());
    window.ltxMgpu = { mode: () => state.mode, mount, refresh: () => schedule(0), status: () => state.last };
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      if (onExecuted) onExecuted.apply(this, arguments);
      if (message) showText(this, message.text);
    };
  },
});
