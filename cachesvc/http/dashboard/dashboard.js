// cachesvc dashboard: everything drawn from the JSON admin API with inline SVG; no libraries,
// no external requests. Every chart element carries data-label / data-value with the exact
// number it shows, so tests (and curious operators) can compare it with the API.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  const state = { node: params.get("node") || "", timer: null, refreshes: 0, key: sessionStorage.getItem("cachesvc-admin-key") || "" };

  function human(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let v = Number(n), i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
  }
  function text(id, value, raw) {
    const el = $(id);
    el.textContent = value;
    el.dataset.value = raw === undefined ? String(value) : String(raw);
  }
  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }
  function clear(id) { const c = $(id); while (c.firstChild) c.removeChild(c.firstChild); return c; }
  function empty(id, message) { const c = clear(id); const p = document.createElement("p"); p.className = "empty"; p.textContent = message; c.appendChild(p); }

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (state.key) headers.Authorization = "Bearer " + state.key;
    const r = await fetch(path, { headers, credentials: "same-origin" });
    if (r.status === 401) { $("keyform").hidden = false; throw new Error("the admin API needs a key: enter it above"); }
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  // Horizontal bars: rows = [{label, value, cls, title}].
  function bars(id, rows, format) {
    if (!rows.length) { empty(id, "nothing yet"); return; }
    const c = clear(id);
    const rowH = 22, labelW = 250, width = 620, max = Math.max(1, ...rows.map((r) => r.value));
    const svg = el("svg", { viewBox: `0 0 ${width} ${rows.length * rowH + 4}`, role: "img" }, c);
    rows.forEach((r, i) => {
      const y = i * rowH + 2;
      const g = el("g", { "data-label": r.label, "data-value": r.value, ...(r.attrs || {}) }, svg);
      el("text", { x: 0, y: y + 14 }, g).textContent = r.label.length > 34 ? r.label.slice(0, 33) + "…" : r.label;
      const w = Math.max(1, ((width - labelW - 90) * r.value) / max);
      const rect = el("rect", { x: labelW, y: y + 3, width: w, height: rowH - 8, class: r.cls || "bundle" }, g);
      el("title", {}, rect).textContent = r.title || r.label;
      el("text", { x: labelW + w + 6, y: y + 14 }, g).textContent = format ? format(r.value) : String(r.value);
    });
  }

  // Stacked hits/misses per model.
  function modelBars(id, perModel) {
    const rows = perModel.filter((m) => m.hits + m.misses > 0);
    if (!rows.length) { empty(id, "no hits or misses yet"); return; }
    const c = clear(id);
    const rowH = 22, labelW = 180, width = 560, max = Math.max(1, ...rows.map((m) => m.hits + m.misses));
    const svg = el("svg", { viewBox: `0 0 ${width} ${rows.length * rowH + 4}`, role: "img" }, c);
    rows.forEach((m, i) => {
      const y = i * rowH + 2, scale = (width - labelW - 90) / max;
      const name = m.model_name || m.model;
      const g = el("g", { "data-label": name, "data-model": m.model, "data-hits": m.hits, "data-misses": m.misses }, svg);
      el("title", {}, g).textContent = m.model;  // the checkpoint (a path stays in the tooltip)
      el("text", { x: 0, y: y + 14 }, g).textContent = name.length > 22 ? name.slice(0, 21) + "…" : name;
      el("rect", { x: labelW, y: y + 3, width: m.hits * scale, height: rowH - 8, class: "hit" }, g);
      el("rect", { x: labelW + m.hits * scale, y: y + 3, width: m.misses * scale, height: rowH - 8, class: "miss" }, g);
      el("text", { x: labelW + (m.hits + m.misses) * scale + 6, y: y + 14 }, g).textContent = `${m.hits} / ${m.misses}`;
    });
  }

  // Size over time: walk the node's events back from the current size (build_ok and adopted
  // bundles added bytes, evictions removed them), then draw it as a step line under the cap.
  function sizeHistory(stats, events) {
    let size = stats.size_bytes;
    const now = Date.now();
    const points = [[now, size]];
    for (const e of events) {
      const t = Date.parse(e.at);
      points.push([t, size]);
      const b = e.bytes || 0;
      if (e.kind === "build_ok" || (e.kind === "reconcile" && e.reason === "adopted")) size -= b;
      else if (e.kind === "evict") size += b;
      size = Math.max(0, size);
      points.push([t, size]);
    }
    return points.reverse();
  }
  function sizeChart(id, stats, events) {
    const c = clear(id);
    const pts = sizeHistory(stats, events);
    const width = 900, height = 220, left = 70, bottom = 24, top = 10;
    const t0 = pts[0][0], t1 = Math.max(pts[pts.length - 1][0], t0 + 1);
    // Scale to the data: a cap far above it (122 MB under 50 GB) would flatten the line onto the
    // axis, so the cap is drawn only within 3x of the peak and labelled off scale otherwise.
    const peak = Math.max(1, ...pts.map((p) => p[1]));
    const capShown = stats.max_size_bytes > 0 && stats.max_size_bytes <= 3 * peak;
    const ymax = (capShown ? Math.max(peak, stats.max_size_bytes) : peak) * 1.1;
    const x = (t) => left + ((width - left - 10) * (t - t0)) / (t1 - t0);
    const y = (v) => top + (height - top - bottom) * (1 - v / ymax);
    const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "data-current": stats.size_bytes, "data-cap": stats.max_size_bytes, "data-points": pts.length, "data-ymax": Math.round(ymax), "data-cap-shown": String(capShown) }, c);
    el("line", { x1: left, y1: y(0), x2: width - 10, y2: y(0), class: "axis" }, svg);
    el("line", { x1: left, y1: top, x2: left, y2: y(0), class: "axis" }, svg);
    if (capShown) {
      const cap = el("line", { x1: left, y1: y(stats.max_size_bytes), x2: width - 10, y2: y(stats.max_size_bytes), class: "cap", "data-value": stats.max_size_bytes }, svg);
      el("title", {}, cap).textContent = "cap " + human(stats.max_size_bytes);
      el("text", { x: 2, y: y(stats.max_size_bytes) + 4 }, svg).textContent = human(stats.max_size_bytes);
    } else {
      el("text", { x: 2, y: y(peak) + 4 }, svg).textContent = human(peak);  // the axis tops at the data
      if (stats.max_size_bytes > 0) {
        el("text", { x: width - 230, y: top + 12, class: "cap-label" }, svg).textContent = "cap " + human(stats.max_size_bytes) + " (off scale ↑)";
      }
    }
    el("text", { x: 2, y: y(0) }, svg).textContent = "0";
    el("path", { d: pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "), class: "size" }, svg);
    el("text", { x: left, y: height - 6 }, svg).textContent = new Date(t0).toLocaleTimeString();
    el("text", { x: width - 80, y: height - 6 }, svg).textContent = new Date(t1).toLocaleTimeString();
  }

  function nodesTable(nodes) {
    const body = $("nodes").tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const n of nodes) {
      const tr = body.insertRow();
      tr.dataset.node = n.name;
      const cells = [n.name, n.state, `${human(n.size_bytes)} / ${human(n.max_size_bytes)}`, n.bundles, `${n.pulled} / ${n.built}`, n.leases,
        n.loaded_models.join(", ") || "–", n.convergence,
        n.heartbeat_age_seconds === null ? "never" : `${Math.round(n.heartbeat_age_seconds)} s ago`];
      cells.forEach((v, i) => { const td = tr.insertCell(); td.textContent = String(v); if (i === 1) td.className = n.state; });
      tr.dataset.bundles = n.bundles; tr.dataset.pulled = n.pulled; tr.dataset.built = n.built; tr.dataset.leases = n.leases; tr.dataset.state = n.state; tr.dataset.sizeBytes = n.size_bytes;
    }
  }

  function fillNodes(list) {
    const select = $("node");
    if (!state.node) state.node = list.this_node;
    const names = list.items.map((n) => n.name);
    if (!names.includes(state.node)) names.push(state.node);
    if (select.options.length !== names.length || [...select.options].some((o, i) => o.value !== names[i])) {
      while (select.firstChild) select.removeChild(select.firstChild);
      for (const name of names) select.add(new Option(name, name));
    }
    select.value = state.node;
  }

  async function refresh() {
    try {
      const list = await api("/admin/nodes");
      fillNodes(list);
      const q = "node=" + encodeURIComponent(state.node);
      const [stats, events, topHits, topSize] = await Promise.all([
        api("/admin/stats?" + q),
        api("/admin/events?limit=1000&" + q),
        api("/admin/bundles?sort=hits&order=desc&limit=10&" + q),
        api("/admin/bundles?sort=size&order=desc&limit=10&" + q),
      ]);
      text("size", human(stats.size_bytes), stats.size_bytes);
      text("cap", human(stats.max_size_bytes), stats.max_size_bytes);
      $("sizebar").style.width = Math.min(100, (100 * stats.size_bytes) / Math.max(1, stats.max_size_bytes)) + "%";
      text("hitrate", stats.hit_rate === null ? "–" : (100 * stats.hit_rate).toFixed(1) + " %", stats.hit_rate === null ? "" : stats.hit_rate);
      text("hits", stats.hits); text("misses", stats.misses);
      text("buildsok", stats.builds_ok); text("buildsfailed", stats.builds_failed);
      text("median", stats.median_build_seconds === null ? "–" : stats.median_build_seconds.toFixed(2) + " s", stats.median_build_seconds === null ? "" : stats.median_build_seconds);
      text("bundles", stats.bundles);
      text("pulls", stats.pulls); text("pushes", stats.pushes);
      text("pulledbytes", human(stats.pulled_bytes), stats.pulled_bytes);
      text("pushedbytes", human(stats.pushed_bytes), stats.pushed_bytes);
      $("bystate").textContent = Object.entries(stats.bundles_by_state).map(([k, v]) => `${v} ${k}`).join(" · ");
      sizeChart("sizechart", stats, events.items);
      bars("evictchart", Object.entries(stats.evictions_by_reason).map(([reason, count]) => ({ label: reason, value: count, cls: "evict", title: `${count} evictions, ${human(stats.evicted_bytes_by_reason[reason] || 0)}` })));
      modelBars("modelchart", stats.per_model);
      const bundleRow = (b, value) => ({ label: `${b.model_name || b.model} · ${b.profile_name}`, value, title: `${b.id}\n${b.model}\n${b.profile_name}`, attrs: { "data-id": b.id } });
      bars("tophits", topHits.items.map((b) => bundleRow(b, b.hit_count)));
      bars("topsize", topSize.items.map((b) => bundleRow(b, b.size_bytes)), human);
      nodesTable(list.items);
      $("error").hidden = true;
      state.refreshes += 1;
      document.body.dataset.refreshes = String(state.refreshes);
      document.body.dataset.node = state.node;
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      $("error").hidden = false;
      $("error").textContent = String(err && err.message ? err.message : err);
    }
  }

  function schedule() {
    if (state.timer) clearInterval(state.timer);
    const seconds = Number($("refresh").value);
    state.timer = seconds > 0 ? setInterval(refresh, seconds * 1000) : null;
  }

  document.addEventListener("DOMContentLoaded", () => {
    const wanted = params.get("refresh");
    if (wanted !== null) {
      const select = $("refresh");
      if (![...select.options].some((o) => o.value === wanted)) select.add(new Option(wanted + " s", wanted));
      select.value = wanted;
    }
    $("node").addEventListener("change", (e) => { state.node = e.target.value; refresh(); });
    $("refresh").addEventListener("change", schedule);
    $("keyform").addEventListener("submit", (e) => {
      e.preventDefault();
      state.key = $("key").value;
      sessionStorage.setItem("cachesvc-admin-key", state.key);
      $("keyform").hidden = true;
      refresh();
    });
    refresh();
    schedule();
  });
})();
