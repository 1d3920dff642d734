// jaxpod dashboard: draws the whole status page from data. Plain JS, no dependencies.
// The first data comes embedded in the page (#initial: the API's own answers); the same
// functions then draw every update: the job list and the cluster are polled, the shown
// job is followed over its server-sent events (status, new metric points, hosts' input).
"use strict";
(function () {
  const W = 480, H = 180, PAD = 28;  // chart size in SVG units
  const JOBS_EVERY_MS = 1000, CLUSTER_EVERY_MS = 3000, DETAIL_EVERY_MS = 5000;
  const RATE_POINTS = 120;
  const CHART_POINTS = 2000;  // a series longer than twice this keeps every other point
  const JOBS_SHOWN = 200;  // the newest jobs; the API pages through all of them
  let jobsOffset = 0;
  const DASH = "–";           // what an empty figure shows
  const PROFILE_SECONDS = 5;  // how long the Profile button traces each host
  const SVG = "http://www.w3.org/2000/svg";
  const initial = JSON.parse(document.getElementById("initial").textContent);
  const caller = initial.caller;  // who is signed in: the page offers what its role may do
  const shown = document.body.dataset.job || "";
  const asked = new URLSearchParams(window.location.search).has("job");
  const series = Object.create(null);  // metric name -> [[step, value]]
  const rate = [];            // [[seconds since the page loaded, steps/s]]
  let last = null;            // the previous status event: {t, step}
  let slicesDrawn = null;     // the slices last drawn (JSON): redrawn only on a change
  const t0 = performance.now();
  let detailAt = t0;          // when the followed job's detail was last fetched

  // An element with attributes (null ones left out) and children (strings become text,
  // never HTML).
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) el.setAttribute(name, value);
    }
    el.append(...children.filter(c => c !== null && c !== undefined).map(
      c => c instanceof Node ? c : String(c)));
    return el;
  }

  function text(el, value) { if (el && el.textContent !== String(value)) el.textContent = value; }
  function fmt(v, d) { return v === null || v === undefined ? DASH : Number(v).toFixed(d); }
  function when(at) { return at ? new Date(at * 1000).toLocaleTimeString() : DASH; }
  function byId(id) { return document.getElementById(id); }

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
    if (r.status === 401) { window.location.href = "/login"; throw new Error("signed out"); }
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  function stateCell(el, state) {
    if (!el) return;
    text(el, state);
    el.className = "state st-" + state;
  }

  // ------------------------------------------------------------------ cluster
  function drawCluster(c) {
    const state = byId("cluster-state");
    text(state, c.state);
    state.className = "st-" + c.state;
    text(byId("free-slices"), c.free_slices);
    text(byId("busy-slices"), c.busy_slices);
    text(byId("num-sessions"), c.num_sessions);
    text(byId("version"), "v" + c.server_version);
    drawTeams(c.teams || []);
    const drawn = JSON.stringify([c.state, c.slices]);
    if (drawn === slicesDrawn) return;
    slicesDrawn = drawn;
    byId("slices").replaceChildren(...(c.slices.length ? c.slices.map(sliceBox)
      : [h("p", {class: "muted"}, "No slices (" + c.state + ").")]));
  }

  function drawTeams(teams) {
    const section = byId("teams");
    section.hidden = !teams.length;
    section.querySelector("tbody").replaceChildren(...teams.map(t => h("tr",
      {"data-team": t.team}, h("td", null, t.team), h("td", null, t.weight),
      h("td", null, t.held), h("td", null, t.entitled.toFixed(1)),
      h("td", null, t.borrowed), h("td", null, t.queued))));
  }

  function sliceBox(s) {
    const hosts = s.hosts.map(host => h("div",
      {class: "host", title: "host " + host.worker_id + " " + host.address},
      h("span", null, "host " + host.worker_id),
      h("span", {class: "chips"}, ...Array.from({length: host.chips}, () => h("i", {class: "chip"}))),
      h("small", null, host.address)));
    return h("div", {class: "slice st-" + s.state, "data-slice": s.name},
      h("div", {class: "slice-head"}, h("b", null, s.name), " ",
        h("span", null, [s.accelerator_type, s.topology, s.num_hosts + "/" + s.expected_hosts +
                         " hosts", s.chips + " chips"].join(" · ")), " ",
        h("span", {class: "state"}, s.state), " ", h("span", {class: "holder"}, s.holder || "")),
      h("div", {class: "hosts"}, ...hosts),
      ...s.problems.map(p => h("p", {class: "bad"}, p)));
  }

  // ------------------------------------------------------------------ jobs
  function drawJobs(list) {
    const body = document.querySelector("#jobs tbody");
    for (const j of list.jobs) {  // creation order: each new row goes on top
      let row = body.querySelector('tr[data-job-id="' + CSS.escape(j.id) + '"]');
      if (!row) {
        row = jobRow(j);
        body.insertBefore(row, body.firstChild);
      }
      updateRow(row, j);
    }
    const empty = body.querySelector("tr.empty");
    if (list.jobs.length && empty) empty.remove();
    if (!body.rows.length) {
      body.append(h("tr", {class: "empty"}, h("td", {colspan: 12, class: "muted"}, "No jobs.")));
    }
    text(byId("updated"), "updated " + new Date().toLocaleTimeString());
  }

  function jobRow(j) {
    return h("tr", {"data-job-id": j.id},
      h("td", null, h("a", {href: "/?job=" + encodeURIComponent(j.id)}, j.id)),
      h("td", null, j.name),
      h("td", {class: "owner"}, (j.owner || DASH) + (j.team && j.team !== "default"
        ? " (" + j.team + ")" : "")),
      h("td", {class: "priority"}, j.priority),
      h("td", null, j.accelerator_type), h("td", {class: "state"}), h("td", {class: "queue"}),
      h("td", {class: "progress"}, h("progress"), " ", h("span", {class: "step"}), "/" + j.steps),
      h("td", {class: "rate"}), h("td", {class: "share"}), h("td", {class: "attempts"}),
      h("td", null, when(j.created_at)));
  }

  function updateRow(row, j) {  // j: a JobSummary (the list's, or a status event's)
    stateCell(row.querySelector(".state"), j.state);
    // A queued job's place (1 is next) and, on hover, what it waits for.
    const queue = row.querySelector(".queue");
    text(queue, j.queue_position === null || j.queue_position === undefined
      ? DASH : j.queue_position + 1);
    queue.title = j.wait_reason || "";
    const bar = row.querySelector("progress");
    bar.max = j.steps;
    bar.value = j.step;
    text(row.querySelector(".step"), j.step);
    text(row.querySelector(".rate"), fmt(j.steps_per_s, 1));
    text(row.querySelector(".share"),
         j.productive_share === null ? DASH : fmt(100 * j.productive_share, 0));
    text(row.querySelector(".attempts"), j.attempts);
  }

  async function newestJobs() {  // the newest JOBS_SHOWN, in creation order
    const page = (offset) => getJSON("/api/v1/jobs?limit=" + JOBS_SHOWN + "&offset=" + offset);
    const list = await page(jobsOffset);
    if (list.total <= jobsOffset + JOBS_SHOWN) return list;
    jobsOffset = list.total - JOBS_SHOWN;  // more jobs since: the window moves on
    return page(jobsOffset);
  }

  async function refreshJobs() {
    try {
      const list = await newestJobs();
      drawJobs(list);
      // A first job while none was shown (and none asked for): show it.
      if (!shown && !asked && list.jobs.length) window.location.reload();
    } catch (e) { /* the next poll tries again */ }
  }

  async function refreshCluster() {
    try {
      drawCluster(await getJSON("/api/v1/cluster"));
    } catch (e) { /* the next poll tries again */ }
  }

  // ------------------------------------------------------------------ the shown job
  function drawDetail(d, wanted) {
    const section = byId("job-detail");
    if (!d) {
      section.replaceChildren(h("h2", null, "Job"), wanted
        ? h("p", {class: "bad"}, "No job " + wanted + ".") : h("p", {class: "muted"}, "No job yet."));
      return;
    }
    section.replaceChildren(h("h2", null, "Job"),
      h("p", null, h("b", null, d.name), " (" + d.id + ", " + (d.owner || DASH) + ") ",
        h("span", {id: "detail-state"}), " step ", h("span", {id: "detail-step"}), "/" + d.steps,
        mayControl(d) ? h("button", {id: "cancel-job", type: "button"}, "Cancel") : null,
        mayControl(d) ? h("button", {id: "profile-job", type: "button",
                                    title: "trace every host with jax.profiler for " +
                                           PROFILE_SECONDS + " s"},
                         "Profile " + PROFILE_SECONDS + " s") : null,
        mayControl(d) ? h("button", {id: "stacks-job", type: "button",
                                    title: "every thread's Python stack on each host, now"},
                         "Stacks") : null,
        mayControl(d) ? h("button", {id: "pin-job", type: "button",
                                    title: "a pinned job is kept whole: retention never prunes it"},
                         "Pin") : null),
      h("p", {id: "detail-kept", class: "muted", hidden: ""}),
      h("pre", {id: "detail-error", class: "bad", hidden: ""}),
      h("pre", {id: "detail-stacks", hidden: ""}),
      h("p", {id: "detail-wait", class: "muted", hidden: ""}),
      h("p", {id: "detail-checkpoint", class: "muted"}),
      h("div", {class: "charts"},
        h("figure", null, h("figcaption", {id: "loss-caption"}), chart("chart-loss", "loss")),
        h("figure", null, h("figcaption", null, "steps/s (live)"), chart("chart-rate", "steps/s"))),
      h("div", {class: "tables"},
        table("goodput", "goodput (s)", []),
        table("history", "history", ["at", "from", "to", "reason"]),
        table("attempts", "attempts", ["#", "on", "started", "ended", "step", "cause"]),
        table("profiles", "profiles (jax.profiler, one host-<i>/ per host)",
              ["started", "seconds", "trace files", "folder"]),
        table("hosts", "hosts of the running attempt", [
          "host", "node", "address", "pid",
          ["s/step", "seconds per step of its recent loops"],
          ["input wait (s)", "seconds its steps waited for input not ready yet"],
          ["queue depth", "chunks of steps ready in its infeed"],
          ["straggler", "why it is flagged (jaxpod job stacks ID shows its stacks)"]])));
    const cancel = byId("cancel-job");
    if (cancel) cancel.addEventListener("click", () => cancelShown(cancel));
    const profile = byId("profile-job");
    if (profile) profile.addEventListener("click", () => profileShown(profile));
    const stacks = byId("stacks-job");
    if (stacks) stacks.addEventListener("click", () => stacksShown(stacks));
    const pin = byId("pin-job");
    if (pin) pin.addEventListener("click", () => pinShown(pin));
    showStatus(d);
    fillDetail(d);
    addPoints(d.series);
  }

  // What the server allows (the role table, and a submitter's own jobs): Cancel and
  // Profile are only offered where the request would succeed.
  function mayControl(j) {
    return caller.role === "admin" || (caller.role === "submitter" && j.owner === caller.name);
  }

  async function cancelShown(button) {
    button.disabled = true;
    const r = await fetch("/api/v1/jobs/" + encodeURIComponent(shown) + "/cancel", {
      method: "POST", credentials: "same-origin", headers: {Accept: "application/json"}});
    if (r.ok) showStatus(await r.json());
    else button.disabled = false;
  }

  // Pin toggles: POST pins, DELETE unpins; the answer is the job's status.
  async function pinShown(button) {
    button.disabled = true;
    try {
      const r = await fetch("/api/v1/jobs/" + encodeURIComponent(shown) + "/pin", {
        method: button.dataset.pinned === "true" ? "DELETE" : "POST",
        credentials: "same-origin", headers: {Accept: "application/json"}});
      if (r.ok) showStatus(await r.json());
    } finally {
      button.disabled = false;
    }
  }

  // A profile answers once the hosts wrote it: the button says so meanwhile.
  async function profileShown(button) {
    button.disabled = true;
    text(button, "Profiling\u2026");
    try {
      await fetch("/api/v1/jobs/" + encodeURIComponent(shown) + "/profile?seconds=" +
                  PROFILE_SECONDS, {method: "POST", credentials: "same-origin",
                                    headers: {Accept: "application/json"}});
      await refreshDetail(shown);
    } finally {
      text(button, "Profile " + PROFILE_SECONDS + " s");
      button.disabled = false;
    }
  }

  // Every host's stacks, read when asked: where a straggling or stuck host is.
  async function stacksShown(button) {
    button.disabled = true;
    try {
      const r = await fetch("/api/v1/jobs/" + encodeURIComponent(shown) + "/stacks", {
        credentials: "same-origin", headers: {Accept: "application/json"}});
      const body = await r.json();
      const pre = byId("detail-stacks");
      text(pre, r.ok ? body.map(x => "== host " + x.host + "  " + x.node + "  pid " + x.pid +
                                     "\n" + x.stacks).join("\n")
                     : body.message);
      pre.hidden = false;
    } finally {
      button.disabled = false;
    }
  }

  function chart(id, metric) {
    const svg = document.createElementNS(SVG, "svg");
    for (const [name, value] of [["id", id], ["class", "chart"], ["viewBox", `0 0 ${W} ${H}`],
                                 ["role", "img"], ["aria-label", metric],
                                 ["data-metric", metric], ["data-points", "0"]]) {
      svg.setAttribute(name, value);
    }
    return svg;
  }

  function table(id, caption, heads) {  // heads: names, or [name, what it means]
    const cells = heads.map(c => Array.isArray(c) ? h("th", {title: c[1]}, c[0]) : h("th", null, c));
    return h("table", {id: id}, h("caption", null, caption),
             cells.length ? h("thead", null, h("tr", null, ...cells)) : null, h("tbody"));
  }

  function draw(svg, points) {
    if (!svg) return;
    svg.dataset.points = String(points.length);
    svg.replaceChildren();
    if (!points.length) return;
    const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = x => PAD + (x - x0) / ((x1 - x0) || 1) * (W - 2 * PAD);
    const sy = y => H - PAD - (y - y0) / ((y1 - y0) || 1) * (H - 2 * PAD);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
    svg.appendChild(line);
    for (const [x, y, label, anchor] of [[4, 14, y1, "start"], [4, H - PAD + 4, y0, "start"],
                                         [W - PAD, H - 6, x1, "end"]]) {
      const t = document.createElementNS(SVG, "text");
      t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor);
      t.textContent = Number(label).toPrecision(4).replace(/\.?0+$/, "");
      svg.appendChild(t);
    }
  }

  // The job's status (its detail, or a status event): the heading, its row, its error.
  function showStatus(j) {
    stateCell(byId("detail-state"), j.state);
    const over = ["SUCCEEDED", "FAILED", "CANCELLED"].includes(j.state);
    const cancel = byId("cancel-job");
    if (cancel) cancel.hidden = over;
    const profile = byId("profile-job");
    if (profile) profile.hidden = j.state !== "RUNNING";
    const stacks = byId("stacks-job");
    if (stacks) stacks.hidden = j.state !== "RUNNING";
    text(byId("detail-step"), j.step);
    const pin = byId("pin-job");
    if (pin) {
      pin.dataset.pinned = String(j.pinned);
      text(pin, j.pinned ? "Unpin" : "Pin");
      pin.hidden = j.pruned_at !== null;  // nothing left to keep
    }
    const kept = byId("detail-kept");
    if (kept) {
      text(kept, j.pinned ? "pinned: retention never prunes it"
        : j.pruned_at !== null ? "pruned by retention at " + when(j.pruned_at) +
          ": a summary of each metric stays; its logs, result and checkpoints were deleted"
        : "");
      kept.hidden = !j.pinned && j.pruned_at === null;
    }
    const wait = byId("detail-wait");
    if (wait) {
      text(wait, j.wait_reason ? "waiting: " + j.wait_reason : "");
      wait.hidden = !j.wait_reason;
    }
    const error = byId("detail-error");
    if (error) {
      text(error, j.error || "");
      error.hidden = !j.error;
    }
    const row = document.querySelector('#jobs tr[data-job-id="' + CSS.escape(j.id) + '"]');
    if (row) updateRow(row, j);
  }

  function fill(tableId, rows, empty) {
    const body = document.querySelector("#" + tableId + " tbody");
    if (!body) return;
    body.replaceChildren(...rows.map(cells => h("tr", null, ...cells.map((value, i) =>
      h(tableId === "goodput" && i === 0 ? "th" : "td", null,
        value === null || value === undefined ? DASH : value)))));
    if (!rows.length && empty) body.append(h("tr", null, h("td", {class: "muted"}, empty)));
  }

  function fillHosts(hosts) {
    fill("hosts", hosts.map(x => [x.host, x.node, x.address, x.pid, fmt(x.step_s, 3),
                                  fmt(x.input_wait_s, 3), x.input_queue_depth,
                                  x.straggler || null]));
  }

  function fillDetail(d) {  // last checkpoint, goodput, history, attempts, profiles, hosts
    const saved = d.checkpoints[d.checkpoints.length - 1];
    text(byId("detail-checkpoint"), saved
      ? "last checkpoint: step " + saved.step + ", " + when(saved.saved_at) + ", " + saved.path +
        (saved.stall_s === null ? "" : " (steps waited " + fmt(saved.stall_s, 3) + " s)")
      : "no checkpoint yet");
    fill("goodput", Object.entries(d.goodput).map(([k, v]) => [k, fmt(v, 3)]), "none yet");
    fill("history", d.history.map(t => [when(t.at), t.from_state, t.to_state, t.reason]));
    fill("attempts", d.attempt_records.map(a => [a.number, a.accelerator_type || "",
                                                  when(a.started_at), when(a.ended_at),
                                                  a.step_reached, a.cause]));
    fill("profiles", d.profiles.map(x => [when(x.started_at), fmt(x.seconds, 3),
                                           x.files.length, x.path]), "none");
    fillHosts(d.hosts);
  }

  // New metric points: the detail's series first, then each metrics event's. The stream
  // starts again from the first step, so a step already kept is skipped.
  function addPoints(fresh) {
    for (const [name, points] of Object.entries(fresh)) {
      let kept = series[name] || (series[name] = []);
      for (const [step, value] of points) {
        if (value !== null && (!kept.length || step > kept[kept.length - 1][0])) kept.push([step, value]);
      }
      if (kept.length > 2 * CHART_POINTS) {  // thin the old, keep the newest point
        const newest = kept[kept.length - 1];
        kept = kept.filter((_, i) => i % 2 === 0);
        if (kept[kept.length - 1] !== newest) kept.push(newest);
        series[name] = kept;
      }
    }
    // The loss if the job records one, else its first metric.
    const metric = "loss" in series ? "loss" : Object.keys(series)[0] || "loss";
    const svg = byId("chart-loss");
    if (!svg) return;
    svg.dataset.metric = metric;
    svg.setAttribute("aria-label", metric);
    text(byId("loss-caption"), metric + " by step");
    draw(svg, series[metric] || []);
  }

  // History, attempts, goodput, last checkpoint: on a state change, and every
  // DETAIL_EVERY_MS while the job reports progress.
  async function refreshDetail(id) {
    detailAt = performance.now();
    try {
      fillDetail(await getJSON("/api/v1/jobs/" + encodeURIComponent(id) + "?points=1"));
    } catch (e) { /* shown as before */ }
  }

  function follow(id, state) {
    let shownState = state;
    const source = new EventSource("/api/v1/jobs/" + encodeURIComponent(id) + "/events");
    source.addEventListener("status", ev => {
      const j = JSON.parse(ev.data);
      showStatus(j);
      if (shownState !== j.state || performance.now() - detailAt > DETAIL_EVERY_MS) {
        refreshDetail(id);
      }
      shownState = j.state;
      const t = (performance.now() - t0) / 1000;
      if (last && j.step > last.step && t > last.t) {
        rate.push([t, (j.step - last.step) / (t - last.t)]);
        if (rate.length > RATE_POINTS) rate.shift();
        draw(byId("chart-rate"), rate);
      }
      last = {t: t, step: j.step};
    });
    source.addEventListener("metrics", ev => addPoints(JSON.parse(ev.data).series));
    source.addEventListener("hosts", ev => fillHosts(JSON.parse(ev.data).hosts));
    source.addEventListener("end", () => { source.close(); refreshDetail(id); });
  }

  text(byId("caller"), caller.name + " (" + caller.role + ")");
  drawCluster(initial.cluster);
  drawJobs(initial.jobs);
  drawDetail(initial.detail, initial.shown);
  setInterval(refreshJobs, JOBS_EVERY_MS);
  setInterval(refreshCluster, CLUSTER_EVERY_MS);
  if (initial.detail) follow(initial.detail.id, initial.detail.state);
})();
