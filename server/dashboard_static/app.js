// The Twinkle dashboard: one JSON route (/dashboard/api/overview), the key from sessionStorage in X-API-Key.
// Everything is drawn with DOM calls and textContent (no innerHTML of server data) and inline SVG (no libraries).
"use strict";

const KEY = "twinkle.dashboard.key";
const REFRESH_MS = 5000;
let timer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function table(headers, rows, cls) {
  const t = el("table", cls ? { class: cls } : {});
  t.append(el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))));
  const body = el("tbody");
  const cell = (c) => (c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c));
  for (const r of rows) body.append(el("tr", {}, ...r.map(cell)));
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: headers.length, class: "hint" }, "none")));
  t.append(body);
  return t;
}

const num = (v) => el("td", { class: "num" }, v);
const bytes = (n) => (n == null ? "-" : n >= 1e6 ? (n / 1e6).toFixed(1) + " MB"
                      : n >= 1e3 ? (n / 1e3).toFixed(1) + " kB" : n + " B");
const when = (iso) => new Date(iso).toLocaleString();

function lossCurve(points) {
  const W = 320, H = 140, P = 28;
  const svg = svgEl("svg", { class: "loss-curve", viewBox: `0 0 ${W} ${H}`, role: "img",
                             "aria-label": `loss over ${points.length} steps` });
  if (!points.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no steps seen by this gateway";
    svg.append(t);
    return svg;
  }
  const losses = points.map((p) => p.loss);
  let lo = Math.min(...losses), hi = Math.max(...losses);
  if (hi === lo) { hi += 1; lo -= 1; }
  const n = points.length;
  const x = (i) => P + (n === 1 ? (W - 2 * P) / 2 : (i * (W - 2 * P)) / (n - 1));
  const y = (v) => H - P + 8 - ((v - lo) * (H - 2 * P)) / (hi - lo);
  const coords = points.map((p, i) => `${x(i).toFixed(1)},${y(p.loss).toFixed(1)}`);
  svg.append(svgEl("polyline", { points: coords.join(" ") }));
  for (const [v, yy] of [[hi, y(hi)], [lo, y(lo)]]) {
    const t = svgEl("text", { x: 2, y: yy + 3 });
    t.textContent = v.toPrecision(3);
    svg.append(t);
  }
  const last = svgEl("text", { x: W - 2, y: H - 4, "text-anchor": "end" });
  last.textContent = `${n} steps, last loss:sum ${losses[n - 1].toPrecision(4)}`;
  svg.append(last);
  return svg;
}

function runCard(run) {
  const badge = el("span", { class: run.live ? "badge" : "badge ended" }, run.live ? "live" : "ended");
  return el("div", { class: "run", "data-run": run.run_id },
    el("div", {}, el("code", {}, run.run_id), " ", badge),
    el("div", { class: "meta" }, `${run.base_model} · ` +
      (run.lora_rank == null ? "full-parameter" : "LoRA rank " + run.lora_rank) +
      ` · last request ${when(run.last_request_time)}`),
    lossCurve(run.losses),
    el("div", { class: "meta" }, run.last_checkpoint ? "last checkpoint " + run.last_checkpoint : "no checkpoint"));
}

function tenantSection(t, operator) {
  const s = el("section", { class: "card tenant", "data-tenant": t.name });
  s.append(el("h2", {}, "Tenant ", el("span", { class: "tenant-name" }, t.name)));
  const u = t.usage;
  s.append(el("h3", {}, "Usage"), table(
    ["tokens trained", "forward", "sampled", "prefilled", "storage", "adapter-hours"],
    [[num(u.tokens_trained), num(u.tokens_forward), num(u.tokens_sampled), num(u.tokens_prefilled),
      num(bytes(u.storage_bytes)), num(u.adapter_hours.toFixed(3))]], "usage"),
    el("p", { class: "hint" }, "Token counts are written every maintenance round: they lag by up to one round."));
  if (operator && t.keys) {
    s.append(el("h3", {}, "API keys"), table(["id", "prefix", "created", "state"],
      t.keys.map((k) => [num(k.key_id), el("code", {}, k.prefix + "…"), when(k.created_at),
                         (k.revoked ? "revoked" : "active") + (k.admin ? ", operator" : "")]), "keys"));
  }
  s.append(el("h3", {}, `Training runs (${t.runs_total})`));
  const grid = el("div", { class: "runs" }, ...t.runs.map(runCard));
  if (!t.runs.length) grid.append(el("p", { class: "hint" }, "none"));
  s.append(grid);
  s.append(el("h3", {}, `Checkpoints (${t.checkpoints_total})`), table(["path", "kind", "saved", "size", "public"],
    t.checkpoints.map((c) => [el("code", {}, c.tinker_path), c.kind, when(c.time), num(bytes(c.size_bytes)),
                              c.public ? "yes" : "no"]), "checkpoints"));
  return s;
}

function serviceSection(svc) {
  const s = el("section", { class: "card", id: "service-card" }, el("h2", {}, "Service"));
  s.append(el("h3", {}, "Queues"), table(["base model", "lane", "queued jobs"],
    svc.queues.map((q) => [q.base_model, q.lane, num(q.depth)]), "queues"));
  s.append(el("p", { class: "hint" }, `jobs held for tenants over a quota: ${svc.held_jobs}`));
  s.append(el("h3", {}, "Adapter pool"), table(["base model", "tier", "adapters", "worker"],
    svc.adapters.map((a) => [a.base_model, a.tier, num(a.adapters), a.worker || "this gateway"]), "adapters"));
  return s;
}

function tenantsSummary(tenants) {
  const s = el("section", { class: "card", id: "tenants-card" }, el("h2", {}, `Tenants (${tenants.length})`));
  s.append(table(["tenant", "active keys", "runs", "checkpoints", "tokens trained", "tokens sampled", "storage"],
    tenants.map((t) => [t.name, num((t.keys || []).filter((k) => !k.revoked).length), num(t.runs_total),
                        num(t.checkpoints_total), num(t.usage.tokens_trained), num(t.usage.tokens_sampled),
                        num(bytes(t.usage.storage_bytes))]), "tenants"));
  return s;
}

function render(data) {
  const operator = data.role === "operator";
  const who = document.getElementById("who");
  who.textContent = operator ? `operator (key of ${data.viewer}) · ${data.tenants.length} tenants`
                             : `tenant ${data.viewer}`;
  who.dataset.role = data.role;
  who.hidden = false;
  const svc = document.getElementById("service");
  const cards = operator && data.service ? [serviceSection(data.service), tenantsSummary(data.tenants)] : [];
  svc.replaceChildren(...cards);
  svc.hidden = !operator;
  document.getElementById("tenants").replaceChildren(...data.tenants.map((t) => tenantSection(t, operator)));
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function showLogin(message) {
  clearTimeout(timer);
  document.getElementById("login").hidden = false;
  document.getElementById("view").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").hidden = true;
  document.getElementById("error").textContent = message || "";
}

async function refresh() {
  const key = sessionStorage.getItem(KEY);
  if (!key) return showLogin("");
  if (document.hidden && !document.getElementById("view").hidden) {  // a tab in the background asks for nothing
    timer = setTimeout(refresh, REFRESH_MS);
    return;
  }
  let r;
  try {
    r = await fetch("/dashboard/api/overview", { headers: { "X-API-Key": key }, cache: "no-store" });
  } catch (e) {
    document.getElementById("updated").textContent = "the server did not answer; retrying";
    timer = setTimeout(refresh, REFRESH_MS);
    return;
  }
  if (r.status === 401) {
    sessionStorage.removeItem(KEY);
    return showLogin("That key was not accepted (unknown or revoked).");
  }
  if (!r.ok) {
    document.getElementById("updated").textContent = `the server answered ${r.status}; retrying`;
  } else {
    document.getElementById("login").hidden = true;
    document.getElementById("view").hidden = false;
    document.getElementById("logout").hidden = false;
    render(await r.json());
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("key");
    sessionStorage.setItem(KEY, input.value.trim());
    input.value = "";
    refresh();
  });
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    showLogin("");
  });
  refresh();
});
