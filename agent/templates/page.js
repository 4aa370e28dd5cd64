// Plots from the JSON beside each .plot div; attempt rows open their details; the live view swaps the body in.
function kloopPlots(root) {
  root.querySelectorAll("div.plot[data-fig]").forEach(function (div) {
    var src = document.getElementById(div.dataset.fig);
    if (!src) return;
    var fig = JSON.parse(src.textContent);
    Plotly.react(div, fig.data, fig.layout, {displaylogo: false, responsive: true,
      modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"]});
    div.on && div.on("plotly_click", function (ev) {
      var p = ev.points && ev.points[0];
      if (p && p.customdata !== undefined) kloopOpen(String(p.customdata), true);
    });
  });
}
var kloopOpened = {};
function kloopOpen(n, scroll) {
  var row = document.querySelector('tr.attempt[data-n="' + n + '"]');
  var det = document.getElementById("attempt-" + n);
  if (!row || !det) return;
  var show = det.hidden || scroll;
  det.hidden = !show;
  row.classList.toggle("open", show);
  if (show) kloopOpened[n] = true; else delete kloopOpened[n];
  if (show && scroll) row.scrollIntoView({block: "center"});
}
function kloopBind(root) {
  root.querySelectorAll("tr.attempt").forEach(function (row) {
    row.addEventListener("click", function () { kloopOpen(row.dataset.n, false); });
  });
  Object.keys(kloopOpened).forEach(function (n) {
    var row = root.querySelector('tr.attempt[data-n="' + n + '"]'), det = document.getElementById("attempt-" + n);
    if (row && det) { det.hidden = false; row.classList.add("open"); }
  });
}
function kloopInit() { var b = document.getElementById("body"); kloopPlots(b); kloopBind(b); }
function kloopLive(bodyUrl, streamUrl, stamp) {
  // `stamp`: the record as the page was rendered; any other stamp from the stream means new events
  var state = document.getElementById("live-state"), last = stamp, busy = false, again = false;
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(bodyUrl, {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.text();
    }).then(function (html) {
      var b = document.getElementById("body");
      var y = window.scrollY;
      b.innerHTML = html;
      kloopPlots(b); kloopBind(b);
      window.scrollTo(0, y);
    }).catch(function (e) { state.textContent = "live: " + e.message; })
      .finally(function () { busy = false; if (again) { again = false; refresh(); } });
  }
  var es = new EventSource(streamUrl, {withCredentials: true});
  es.addEventListener("record", function (ev) {
    var d = JSON.parse(ev.data);
    state.textContent = "live: " + d.events + " events" + (d.ended ? " (session ended)" : "");
    if (d.stamp !== last) refresh();
    last = d.stamp;
  });
  es.onerror = function () { state.textContent = "live: reconnecting…"; };
}
document.addEventListener("DOMContentLoaded", kloopInit);
