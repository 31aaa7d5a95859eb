// LTX-2 Multi-GPU: the pool panel's view (no ComfyUI imports, so it can be tested on its own).
// Input: the JSON of GET /ltx_mgpu/status (nodes/routes.py status_payload).

const GIB = 1024 ** 3;

/** Bytes as "12.3 GiB" / "512 MiB" / "549 KiB" ("-" for null). */
export function formatBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "-";
  if (n >= GIB) return `${(n / GIB).toFixed(1)} GiB`;
  if (n >= 1024 ** 2) return `${Math.round(n / 1024 ** 2)} MiB`;
  return `${Math.round(n / 1024)} KiB`;
}

/**
 * One memory bar per rank: {label, used, total, fraction (0..1), text, detail}.
 * CUDA ranks: used = total - free (the whole GPU, other processes included), detail = what the
 * rank's torch reserved. CPU ranks: the process's resident memory against the machine's RAM.
 */
export function rankBars(pool) {
  return (pool.ranks || []).map((r) => {
    const m = r.memory || {};
    const cuda = String(r.device || "").startsWith("cuda");
    const total = m.total ?? null;
    const used = cuda ? (total !== null && m.free != null ? total - m.free : m.reserved ?? null) : m.rss ?? null;
    const fraction = total && used !== null ? Math.min(1, Math.max(0, used / total)) : 0;
    // "ltx · 9.6 GiB shard": a model's name, the weight bytes this rank holds, "shard" when sharded.
    const models = Object.entries(r.models || {}).map(([name, info]) => {
      const held = info && Number.isFinite(info.bytes) ? ` · ${formatBytes(info.bytes)}` : "";
      return `${name}${held}${info && info.plan && info.plan.weights === "sharded" ? " shard" : ""}`;
    });
    return {
      label: `rank ${r.rank} · ${r.device}`,
      used,
      total,
      fraction,
      text: `${formatBytes(used)} / ${formatBytes(total)}`,
      detail: cuda ? `torch reserved ${formatBytes(m.reserved)}` : "process RSS",
      models,
    };
  });
}

/** What a person reads for each pool job type (the pool's own names are internal). */
export const JOB_NAMES = {
  start: "Starting the pool",
  load_text_encoder: "Loading Gemma",
  encode: "Encoding prompts",
  load_transformer: "Loading the LTX-2 transformer",
  sample: "Sampling (SP Sampler)",
  text_contexts: "Preparing the prompts for ComfyUI's sampler",
  forward: "ComfyUI's sampler: a model call",
  model_patches: "Applying LoRAs",
  comfy_sampling: "ComfyUI's sampler",
  unload: "Freeing memory",
  selftest: "Self-test",
};

/** The phases of a job (ltx_mgpu/client/phases.py PHASE_LABELS: the same words everywhere). */
export const PHASE_NAMES = {
  pool: "starting the pool",
  convert: "converting the model",
  load_text_encoder: "loading Gemma",
  encode: "encoding the prompts",
  compile: "compiling",
  load_transformer: "loading the LTX-2 transformer",
  denoise: "denoising",
  decode: "decoding",
  selftest: "self-test",
};

/** "Sampling (SP Sampler) · denoising 3/20 · 41 s" for a pool's current job, or "" when idle. */
export function jobText(pool) {
  const cur = pool.current;
  if (!cur) return "";
  const p = cur.progress || {};
  const name = JOB_NAMES[cur.type] || String(cur.type || "").replace(/_/g, " ");
  const phase = p.phase ? PHASE_NAMES[p.phase] || p.phase : "";
  const step = p.total > 1 ? ` ${p.step}/${p.total}` : "";
  const shown = phase && phase.toLowerCase() !== name.toLowerCase() ? ` · ${phase}${step}` : step;
  const elapsed = Number.isFinite(cur.elapsed) ? ` · ${Math.max(0, Math.floor(cur.elapsed))} s` : "";
  return `${name}${shown}${elapsed}`;
}

/** Plain view model of a status payload (what the panel shows). */
export function summarize(payload) {
  if (!payload) return { message: "no status yet", pools: [], busy: false };
  if (!payload.available) return { message: payload.message || "the pool cannot run here", pools: [], busy: false };
  const pools = (payload.pools || []).map((p) => ({
    key: p.key,
    title: p.gpus && p.gpus.length ? `GPUs ${p.gpus.join(",")}` : `CPU × ${p.nproc}`,
    state: p.state,
    error: p.error || null,
    job: jobText(p),
    queued: (p.queue || []).length,
    bars: rankBars(p),
  }));
  return {
    message: pools.length ? null : "no pool yet: it starts with the first LTX-2 Multi-GPU job",
    pools,
    busy: pools.some((p) => p.state === "busy" || p.state === "starting" || p.queued > 0),
  };
}

function el(doc, tag, cls, text) {
  const e = doc.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** Replace `container`'s content with the view of `payload`; `onFree` handles the Free button. */
export function renderPanel(container, payload, onFree, doc = document) {
  const view = summarize(payload);
  container.replaceChildren();
  container.classList.add("ltx-mgpu-panel");
  const head = el(doc, "div", "ltx-mgpu-head");
  head.append(el(doc, "span", "ltx-mgpu-title", "LTX-2 Multi-GPU pool"));
  if (onFree && view.pools.some((p) => p.state === "idle" || p.state === "busy")) {
    const btn = el(doc, "button", "ltx-mgpu-free", "Free");
    btn.title = "Unload Gemma and the LTX-2 transformer from the pool's GPUs";
    btn.addEventListener("click", () => onFree(btn));
    head.append(btn);
  }
  container.append(head);
  if (view.message) container.append(el(doc, "div", "ltx-mgpu-message", view.message));
  for (const p of view.pools) {
    const box = el(doc, "div", "ltx-mgpu-pool");
    box.dataset.state = p.state;
    const line = el(doc, "div", "ltx-mgpu-pool-head");
    line.append(el(doc, "span", "ltx-mgpu-pool-title", p.title));
    line.append(el(doc, "span", `ltx-mgpu-state ltx-mgpu-state-${p.state.replace(/\s+/g, "-")}`, p.state));
    box.append(line);
    if (p.error) box.append(el(doc, "div", "ltx-mgpu-error", p.error));
    if (p.job) box.append(el(doc, "div", "ltx-mgpu-job", p.job + (p.queued ? ` (+${p.queued} queued)` : "")));
    for (const b of p.bars) {
      const row = el(doc, "div", "ltx-mgpu-rank");
      const label = el(doc, "div", "ltx-mgpu-rank-label");
      label.append(el(doc, "span", null, b.label), el(doc, "span", "ltx-mgpu-rank-mem", b.text));
      const bar = el(doc, "div", "ltx-mgpu-bar");
      bar.title = b.detail;
      const fill = el(doc, "div", "ltx-mgpu-bar-fill");
      fill.style.width = `${(b.fraction * 100).toFixed(1)}%`;
      if (b.fraction > 0.9) fill.classList.add("ltx-mgpu-bar-high");
      bar.append(fill);
      row.append(label, bar);
      if (b.models.length) row.append(el(doc, "div", "ltx-mgpu-models", b.models.join(", ")));
      box.append(row);
    }
    container.append(box);
  }
  return view;
}
