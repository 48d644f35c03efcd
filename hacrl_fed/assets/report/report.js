// hacrl-fed report (hacrl_fed/report/page.py): draws every section from the JSON in #report-data.
// No network, no library. Data is only ever written with textContent / setAttribute, never parsed as HTML.
"use strict";
(function () {
  var status = document.getElementById("status");
  var errors = [];
  function fail(msg) {
    errors.push(String(msg));
    status.setAttribute("data-state", "error");
    status.setAttribute("data-errors", errors.join(" | "));
  }
  window.addEventListener("error", function (e) { fail(e.message); });

  var D = JSON.parse(document.getElementById("report-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
  var counts = {};

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function sv(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  function fmt(v, d) { return v === null || v === undefined ? "–" : Number(v).toFixed(d === undefined ? 3 : d); }
  function color(i) { return COLORS[i % COLORS.length]; }
  function range(vals, lo, hi) {
    var a = Math.min.apply(null, vals.concat(lo === undefined ? [] : [lo]));
    var b = Math.max.apply(null, vals.concat(hi === undefined ? [] : [hi]));
    return b > a ? [a, b] : [a, a + 1];
  }
  // Tick values over [a, b]: five evenly spaced, or every integer when integer ticks are asked for and few.
  function ticks(r, integer) {
    var out = [], i;
    if (integer && r[1] - r[0] <= 5) {
      for (i = Math.ceil(r[0]); i <= r[1]; i++) out.push(i);
      return out;
    }
    if (integer) {  // a round step (1, 2, 5 × 10^k) giving at most 6 ticks
      var raw = (r[1] - r[0]) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
      var step = Math.max(1, [1, 2, 5, 10].map(function (m) { return m * mag; }).filter(function (c) { return c >= raw; })[0]);
      for (i = Math.ceil(r[0] / step) * step; i <= r[1]; i += step) out.push(i);
      return out;
    }
    for (i = 0; i <= 4; i++) out.push(r[0] + (r[1] - r[0]) * i / 4);
    return out;
  }
  function empty(box, id, why) { box.appendChild(el("p", { "class": "empty" }, why)); counts[id] = 0; }

  // A line chart of {name: [[x, y], ...]}: one polyline and one circle.pt per point, a legend on the right.
  function lineChart(id, data, opts) {
    var box = document.getElementById(id), names = Object.keys(data);
    if (!names.length) return empty(box, id, "no data in metrics.jsonl");
    var W = 640, H = 260, L = 48, R = 120, T = 12, B = 34, xs = [], ys = [], n = 0;
    names.forEach(function (k) { data[k].forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    var xr = range(xs), yr = range(ys, opts.y0, opts.y1);
    function sx(x) { return L + (x - xr[0]) / (xr[1] - xr[0]) * (W - L - R); }
    function sy(y) { return H - B - (y - yr[0]) / (yr[1] - yr[0]) * (H - T - B); }
    var s = sv("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    ticks(yr, false).forEach(function (yv) {
      s.appendChild(sv("line", { "class": "grid-line", x1: L, x2: W - R, y1: sy(yv), y2: sy(yv) }));
      s.appendChild(sv("text", { x: L - 4, y: sy(yv) + 4, "text-anchor": "end" }, fmt(yv, 2)));
    });
    ticks(xr, true).forEach(function (xv) {
      s.appendChild(sv("text", { x: sx(xv), y: H - B + 14, "text-anchor": "middle" }, fmt(xv, 0)));
    });
    s.appendChild(sv("line", { "class": "axis", x1: L, x2: L, y1: T, y2: H - B }));
    s.appendChild(sv("line", { "class": "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    s.appendChild(sv("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, opts.x || "round"));
    names.forEach(function (k, j) {
      var pts = data[k].map(function (p) { return sx(p[0]) + "," + sy(p[1]); }).join(" ");
      s.appendChild(sv("polyline", { points: pts, fill: "none", stroke: color(j), "stroke-width": 1.5 }));
      data[k].forEach(function (p) {
        var c = sv("circle", { "class": "pt", cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color(j) });
        c.appendChild(sv("title", {}, k + ", round " + p[0] + ": " + fmt(p[1])));
        s.appendChild(c);
        n++;
      });
      s.appendChild(sv("rect", { x: W - R + 10, y: T + j * 16, width: 10, height: 10, fill: color(j) }));
      s.appendChild(sv("text", { x: W - R + 24, y: T + j * 16 + 9 }, k));
    });
    box.appendChild(s);
    counts[id] = n;
  }

  function headerTable() {
    var t = document.getElementById("header-table");
    var hr = el("tr");
    ["org", "held-out accuracy (rounds)", "before → after", "train reward first → last"].forEach(function (h) {
      hr.appendChild(el("th", {}, h));
    });
    t.appendChild(hr);
    D.header.forEach(function (r) {
      var tr = el("tr");
      tr.appendChild(el("td", {}, r.org));
      tr.appendChild(el("td", {}, r.acc_rounds ? r.acc_rounds[0] + " → " + r.acc_rounds[1] : "–"));
      tr.appendChild(el("td", {}, fmt(r.acc_before) + " → " + fmt(r.acc_after)));
      tr.appendChild(el("td", {}, fmt(r.reward_first) + " → " + fmt(r.reward_last)));
      t.appendChild(tr);
    });
    counts["header-table"] = D.header.length;
  }

  // Learner × source: rows received, kept (trained) and dropped per stage/reason, summed over the run.
  function matrix() {
    var t = document.getElementById("matrix-table"), learners = Object.keys(D.matrix).sort(), srcs = {};
    learners.forEach(function (l) { Object.keys(D.matrix[l]).forEach(function (s) { srcs[s] = 1; }); });
    var sources = Object.keys(srcs).sort();
    if (!learners.length) { t.parentNode.insertBefore(el("p", { "class": "empty" }, "no intake counters in metrics.jsonl"), t); counts["matrix-table"] = 0; return; }
    var hr = el("tr");
    hr.appendChild(el("th", {}, "learner ↓  source →"));
    sources.forEach(function (s) { hr.appendChild(el("th", {}, s)); });
    t.appendChild(hr);
    var cells = 0;
    learners.forEach(function (l) {
      var tr = el("tr");
      tr.appendChild(el("th", {}, l));
      sources.forEach(function (s) {
        var c = D.matrix[l][s], td = el("td", { "data-learner": l, "data-source": s });
        if (c) {
          var frac = c.received ? c.kept / c.received : 0;
          td.style.background = "rgba(26,127,55," + (0.08 + 0.35 * frac).toFixed(2) + ")";
          td.appendChild(el("div", { "class": "cell-kept" }, "kept " + c.kept + " / " + c.received + " received"));
          var ul = el("ul", { "class": "reasons" });
          Object.keys(c.dropped).sort().forEach(function (why) { ul.appendChild(el("li", {}, why + ": " + c.dropped[why])); });
          if (ul.childNodes.length) td.appendChild(ul);
          cells++;
        } else td.textContent = "–";
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
    counts["matrix-table"] = cells;
  }

  function events() {
    var id = "chart-events", box = document.getElementById(id), ev = D.events;
    if (!ev.length) { empty(box, id, "no trust events (no exclusion, drop, validation, rollback or accusation)"); return; }
    var kinds = [], seen = {};
    ev.forEach(function (e) { if (!seen[e.kind]) { seen[e.kind] = 1; kinds.push(e.kind); } });
    var orgs = D.orgs.concat(ev.map(function (e) { return e.org; }).filter(function (o) { return D.orgs.indexOf(o) < 0; }));
    var W = 640, L = 110, R = 120, T = 10, lane = 22, H = Math.max(T + kinds.length * lane, T + D.orgs.length * 16) + 30;
    var xr = range(ev.map(function (e) { return e.round; }).concat([0, D.rounds]));
    function sx(x) { return L + (x - xr[0]) / (xr[1] - xr[0]) * (W - L - R); }
    var s = sv("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    kinds.forEach(function (k, i) {
      var y = T + i * lane + lane / 2;
      s.appendChild(sv("line", { "class": "grid-line", x1: L, x2: W - R, y1: y, y2: y }));
      s.appendChild(sv("text", { x: L - 6, y: y + 4, "text-anchor": "end" }, k));
    });
    var n = 0;
    ev.forEach(function (e) {
      var oi = orgs.indexOf(e.org), y = T + kinds.indexOf(e.kind) * lane + lane / 2 + (oi % 3 - 1) * 5;
      var c = sv("circle", { "class": "pt", cx: sx(e.round), cy: y, r: 3, fill: color(oi), "fill-opacity": 0.7 });
      c.appendChild(sv("title", {}, "round " + e.round + ": " + e.text));
      s.appendChild(c);
      n++;
    });
    orgs.forEach(function (o, j) {
      s.appendChild(sv("rect", { x: W - R + 10, y: T + j * 16, width: 10, height: 10, fill: color(j) }));
      s.appendChild(sv("text", { x: W - R + 24, y: T + j * 16 + 9 }, o));
    });
    s.appendChild(sv("line", { "class": "axis", x1: L, x2: W - R, y1: H - 24, y2: H - 24 }));
    ticks(xr, true).forEach(function (xv) {
      s.appendChild(sv("text", { x: sx(xv), y: H - 10, "text-anchor": "middle" }, fmt(xv, 0)));
    });
    box.appendChild(s);
    counts[id] = n;
    var sel = document.getElementById("event-kind");
    kinds.forEach(function (k) { sel.appendChild(el("option", { value: k }, k)); });
    sel.addEventListener("change", eventTable);
    eventTable();
    if (D.events_total > ev.length) box.appendChild(el("p", { "class": "empty" }, (D.events_total - ev.length) + " later events not listed"));
  }

  function eventTable() {
    var t = document.getElementById("events-table"), kind = document.getElementById("event-kind").value;
    t.textContent = "";
    var hr = el("tr");
    ["round", "kind", "org", "event"].forEach(function (h) { hr.appendChild(el("th", {}, h)); });
    t.appendChild(hr);
    var rows = D.events.filter(function (e) { return !kind || e.kind === kind; });
    rows.slice(0, 300).forEach(function (e) {
      var tr = el("tr");
      [e.round, e.kind, e.org, e.text].forEach(function (v) { tr.appendChild(el("td", {}, v)); });
      t.appendChild(tr);
    });
    document.getElementById("events-count").textContent = rows.length + " events" + (rows.length > 300 ? " (first 300 listed)" : "");
  }

  // Mean seconds per round of each phase, one stacked bar per org.
  function phases() {
    var id = "chart-phases", box = document.getElementById(id), orgs = Object.keys(D.phases);
    if (!orgs.length) return empty(box, id, "no time/... keys in metrics.jsonl");
    var names = [];
    orgs.forEach(function (o) { Object.keys(D.phases[o]).forEach(function (p) { if (names.indexOf(p) < 0) names.push(p); }); });
    var totals = orgs.map(function (o) { return names.reduce(function (a, p) { return a + (D.phases[o][p] || 0); }, 0); });
    var W = 640, L = 90, R = 150, T = 10, bar = 22, mx = Math.max.apply(null, totals) || 1;
    var H = Math.max(T + orgs.length * (bar + 8), T + names.length * 16) + 10;
    var s = sv("svg", { viewBox: "0 0 " + W + " " + H, role: "img" }), n = 0;
    orgs.forEach(function (o, i) {
      var x = L, y = T + i * (bar + 8), room = W - L - R - 50;
      s.appendChild(sv("text", { x: L - 6, y: y + bar / 2 + 4, "text-anchor": "end" }, o));
      names.forEach(function (p, j) {
        var v = D.phases[o][p] || 0, w = v / mx * room;
        if (v <= 0) return;
        var r = sv("rect", { "class": "pt", x: x, y: y, width: Math.max(w, 0.5), height: bar, fill: color(j) });
        r.appendChild(sv("title", {}, o + " " + p + ": " + fmt(v) + " s per round"));
        s.appendChild(r);
        x += w;
        n++;
      });
      s.appendChild(sv("text", { x: x + 4, y: y + bar / 2 + 4 }, fmt(totals[i], 2) + " s"));
    });
    names.forEach(function (p, j) {
      s.appendChild(sv("rect", { x: W - R + 10, y: T + j * 16, width: 10, height: 10, fill: color(j) }));
      s.appendChild(sv("text", { x: W - R + 24, y: T + j * 16 + 9 }, p));
    });
    box.appendChild(s);
    counts[id] = n;
  }

  // The rollout viewer: filters over D.samples, the first 200 matching rows as text.
  var MAX_ROWS = 200;
  function fateOf(r) { return r.kind === "own" ? "own" : r.fate; }
  function viewer() {
    var sel = document.getElementById("f-org");
    D.orgs.forEach(function (o) { sel.appendChild(el("option", { value: o }, o)); });
    ["f-org", "f-fate", "f-round-min", "f-round-max", "f-reward-min", "f-reward-max", "f-text"].forEach(function (id) {
      document.getElementById(id).addEventListener("input", renderRows);
    });
    var info = document.getElementById("samples-info");
    Object.keys(D.samples_info).sort().forEach(function (o) {
      var i = D.samples_info[o];
      info.appendChild(el("span", {}, o + ": " + i.rows + " rows, " + (i.bytes / 1024).toFixed(0) + " KiB" +
        (i.shown < i.rows ? " (" + i.shown + " shown)" : "") + ";  "));
    });
    renderRows();
  }
  function num(id) { var v = document.getElementById(id).value; return v === "" ? null : Number(v); }
  function renderRows() {
    var org = document.getElementById("f-org").value, fate = document.getElementById("f-fate").value;
    var r0 = num("f-round-min"), r1 = num("f-round-max"), w0 = num("f-reward-min"), w1 = num("f-reward-max");
    var q = document.getElementById("f-text").value.toLowerCase();
    var rows = D.samples.filter(function (r) {
      return (!org || r.org === org || r.source === org) && (!fate || fateOf(r) === fate) &&
        (r0 === null || r.round >= r0) && (r1 === null || r.round <= r1) &&
        (w0 === null || r.reward >= w0) && (w1 === null || r.reward <= w1) &&
        (!q || String(r.response).toLowerCase().indexOf(q) >= 0 || String(r.prompt).toLowerCase().indexOf(q) >= 0);
    });
    var t = document.getElementById("viewer-table");
    t.textContent = "";
    var hr = el("tr");
    ["round", "org", "from → to", "fate", "reward", "stop", "length", "prompt", "response"].forEach(function (h) {
      hr.appendChild(el("th", {}, h));
    });
    t.appendChild(hr);
    rows.slice(0, MAX_ROWS).forEach(function (r) {
      var tr = el("tr", { "class": "sample-row" }), f = fateOf(r);
      tr.appendChild(el("td", {}, r.round));
      tr.appendChild(el("td", {}, r.org));
      tr.appendChild(el("td", {}, r.kind === "own" ? r.source : r.source + " → " + r.learner));
      tr.appendChild(el("td", { "class": "fate-" + f }, f === "own" ? "own rollout" : f + " (" + r.stage + ": " + r.reason + ")"));
      tr.appendChild(el("td", {}, fmt(r.reward, 2)));
      tr.appendChild(el("td", {}, r.stop_reason));
      tr.appendChild(el("td", {}, r.length));
      var p = el("td"), x = el("td");
      p.appendChild(el("pre", { "class": "text" }, r.prompt));
      x.appendChild(el("pre", { "class": "text response" }, r.response));
      tr.appendChild(p);
      tr.appendChild(x);
      t.appendChild(tr);
    });
    document.getElementById("viewer-count").textContent = rows.length + " of " + D.samples.length + " rows match" +
      (rows.length > MAX_ROWS ? " (first " + MAX_ROWS + " shown)" : "");
    counts["viewer-table"] = Math.min(rows.length, MAX_ROWS);
  }

  try {
    headerTable();
    lineChart("chart-eval", D.eval, { y0: 0, y1: 1 });
    lineChart("chart-reward", D.reward, { y0: 0, y1: 1 });
    lineChart("chart-capability", D.capability, { y0: 0, y1: 1 });
    matrix();
    events();
    phases();
    viewer();
    document.getElementById("summary").textContent = D.summary || "(no summary.txt yet: the run is in progress)";
  } catch (err) {
    fail(err && err.stack ? err.stack : err);
  }
  status.setAttribute("data-counts", JSON.stringify(counts));
  if (!errors.length) status.setAttribute("data-state", "ok");
  status.textContent = errors.length ? "rendering failed: " + errors.join(" | ") : "rendered " + D.generated;
})();
