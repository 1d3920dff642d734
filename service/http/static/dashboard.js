// jaxpod dashboard: keeps the server-rendered page live. Plain JS, no dependencies.
// The job table is polled; the shown job is followed over its server-sent events
// (its status and new metric points), and its charts are redrawn as points arrive.
"use strict";
(function () {
  const W = 480, H = 180, PAD = 28;
  const JOBS_EVERY_MS = 1000, CLUSTER_EVERY_MS = 3000, RATE_POINTS = 120;
  const CHART_POINTS = 2000;  // a series longer than twice this keeps every other point
  const shown = document.body.dataset.job || "";
  const asked = new URLSearchParams(window.location.search).has("job");
  const series = {};          // metric name -> [[step, value]]
  const rate = [];            // [[seconds since follow, steps/s]]
  let last = null;            // the previous status event: {t, step}
  const t0 = performance.now();

  function text(el, value) { if (el && el.textContent !== String(value)) el.textContent = value; }
  function fmt(v, d) { return v === null || v === undefined ? "–" : Number(v).toFixed(d); }

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
    if (r.status === 401) { window.location.href = "/login"; throw new Error("signed out"); }
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  function stateCell(td, state) {
    text(td, state);
    td.className = "state st-" + state;
  }

  function updateRow(row, j) {
    stateCell(row.querySelector(".state"), j.state);
    const bar = row.querySelector("progress");
    if (bar) { bar.max = j.steps; bar.value = j.step; }
    text(row.querySelector(".step"), j.step);
    text(row.querySelector(".rate"), fmt(j.steps_per_s, 1));
    text(row.querySelector(".share"),
         j.productive_share === null ? "–" : fmt(100 * j.productive_share, 0));
  }

  function newRow(j) {
    const row = document.createElement("tr");
    row.dataset.jobId = j.id;
    const cells = [["a", j.id], ["", j.name], ["", j.accelerator_type], ["state", j.state],
                   ["progress", ""], ["rate", ""], ["share", ""], ["", j.attempts],
                   ["", new Date(j.created_at * 1000).toLocaleTimeString()]];
    for (const [kind, value] of cells) {
      const td = document.createElement("td");
      if (kind === "a") {
        const a = document.createElement("a");
        a.href = "/?job=" + encodeURIComponent(j.id);
        a.textContent = value;
        td.appendChild(a);
      } else if (kind === "progress") {
        td.className = "progress";
        td.appendChild(document.createElement("progress"));
        const s = document.createElement("span");
        s.className = "step";
        td.appendChild(s);
        td.appendChild(document.createTextNode("/" + j.steps));
      } else {
        if (kind) td.className = kind;
        td.textContent = value;
      }
      row.appendChild(td);
    }
    updateRow(row, j);
    return row;
  }

  async function refreshJobs() {
    try {
      const list = await getJSON("/api/v1/jobs?limit=200");
      const body = document.querySelector("#jobs tbody");
      for (const j of list.jobs) {
        let row = body.querySelector('tr[data-job-id="' + CSS.escape(j.id) + '"]');
        if (!row) {
          const empty = body.querySelector("td.muted");
          if (empty) empty.parentElement.remove();
          row = newRow(j);
          body.insertBefore(row, body.firstChild);
        } else {
          updateRow(row, j);
        }
      }
      // A first job while none was shown (and none asked for): show it.
      if (!shown && !asked && list.jobs.length) window.location.reload();
      text(document.getElementById("updated"), "updated " + new Date().toLocaleTimeString());
    } catch (e) { /* the next poll tries again */ }
  }

  async function refreshCluster() {
    try {
      const c = await getJSON("/api/v1/cluster");
      text(document.getElementById("cluster-state"), c.state);
      text(document.getElementById("free-slices"), c.free_slices);
      text(document.getElementById("busy-slices"), c.busy_slices);
      text(document.getElementById("num-sessions"), c.num_sessions);
      for (const s of c.slices) {
        const el = document.querySelector('[data-slice="' + CSS.escape(s.name) + '"]');
        if (!el) continue;
        el.className = "slice st-" + s.state;
        text(el.querySelector(".state"), s.state);
        text(el.querySelector(".holder"), s.holder || "");
      }
    } catch (e) { /* the next poll tries again */ }
  }

  function draw(svg, points) {
    if (!svg) return;
    svg.dataset.points = String(points.length);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (!points.length) return;
    const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = x => PAD + (x - x0) / ((x1 - x0) || 1) * (W - 2 * PAD);
    const sy = y => H - PAD - (y - y0) / ((y1 - y0) || 1) * (H - 2 * PAD);
    const ns = "http://www.w3.org/2000/svg";
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
    svg.appendChild(line);
    for (const [x, y, label, anchor] of [[4, 14, y1, "start"], [4, H - PAD + 4, y0, "start"],
                                         [W - PAD, H - 6, x1, "end"]]) {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor);
      t.textContent = Number(label).toPrecision(4).replace(/\.?0+$/, "");
      svg.appendChild(t);
    }
  }

  function when(at) { return at ? new Date(at * 1000).toLocaleTimeString() : "–"; }

  function fill(tableId, rows) {
    const body = document.querySelector("#" + tableId + " tbody");
    if (!body) return;
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const cells of rows) {
      const tr = document.createElement("tr");
      cells.forEach((value, i) => {
        const td = document.createElement(tableId === "goodput" && i === 0 ? "th" : "td");
        td.textContent = value === null || value === undefined ? "–" : String(value);
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  function fillHosts(hosts) {
    fill("hosts", hosts.map(h => [h.host, fmt(h.input_wait_s, 3), h.input_queue_depth]));
  }

  async function refreshDetail(id) {  // history, attempts, goodput: on a state change
    try {
      const d = await getJSON("/api/v1/jobs/" + encodeURIComponent(id) + "?points=1");
      fill("goodput", Object.entries(d.goodput).map(([k, v]) => [k, fmt(v, 3)]));
      fillHosts(d.hosts);
      fill("history", d.history.map(t => [when(t.at), t.from_state, t.to_state, t.reason]));
      fill("attempts", d.attempt_records.map(a => [a.number, when(a.started_at),
                                                    when(a.ended_at), a.step_reached, a.cause]));
    } catch (e) { /* shown as rendered */ }
  }

  function follow(id) {
    let shownState = null;
    const lossSvg = document.getElementById("chart-loss");
    const metric = lossSvg ? lossSvg.dataset.metric : "loss";
    const source = new EventSource("/api/v1/jobs/" + encodeURIComponent(id) + "/events");
    source.addEventListener("status", ev => {
      const j = JSON.parse(ev.data);
      stateCell(document.getElementById("detail-state"), j.state);
      if (shownState !== null && shownState !== j.state) refreshDetail(id);
      shownState = j.state;
      text(document.getElementById("detail-step"), j.step);
      const row = document.querySelector('#jobs tr[data-job-id="' + CSS.escape(j.id) + '"]');
      if (row) updateRow(row, j);
      const t = (performance.now() - t0) / 1000;
      if (last && j.step > last.step && t > last.t) {
        rate.push([t, (j.step - last.step) / (t - last.t)]);
        if (rate.length > RATE_POINTS) rate.shift();
        draw(document.getElementById("chart-rate"), rate);
      }
      last = {t: t, step: j.step};
    });
    source.addEventListener("metrics", ev => {
      const fresh = JSON.parse(ev.data).series;
      for (const [name, points] of Object.entries(fresh)) {
        const kept = series[name] || (series[name] = []);
        for (const [step, value] of points) if (value !== null) kept.push([step, value]);
        if (kept.length > 2 * CHART_POINTS) {  // thin the old, keep the newest point
          const newest = kept[kept.length - 1];
          const every = kept.filter((_, i) => i % 2 === 0);
          if (every[every.length - 1] !== newest) every.push(newest);
          series[name] = every;
        }
      }
      draw(lossSvg, series[metric] || []);
    });
    source.addEventListener("hosts", ev => fillHosts(JSON.parse(ev.data).hosts));
    source.addEventListener("end", () => { source.close(); refreshDetail(id); });
  }

  setInterval(refreshJobs, JOBS_EVERY_MS);
  setInterval(refreshCluster, CLUSTER_EVERY_MS);
  if (shown) follow(shown);
})();
