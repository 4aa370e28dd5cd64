"""`kloop serve`: a read-only web app over a folder of run records (Starlette, served by uvicorn).

    /                          the runs, refreshed every few seconds
    /runs/RUN                  the run's report, live: the page listens on /runs/RUN/stream and
                               swaps in /runs/RUN/body when the record grows
    /runs/RUN/stream           Server-Sent Events: one `record` event per change of events.jsonl
    /runs/RUN/report.html      the self-contained report, as `kloop report` writes it
    /compare?a=RUN&b=RUN       two runs side by side
    /static/plotly-HASH.min.js plotly.js, named by its hash: sent once (immutable, ETag), gzipped

Only GET routes; the app reads run.json, events.jsonl, patches and notes.md, never the session's
worktree or process (the record is written ahead, so it is the live state). It binds 127.0.0.1 by
default (and then answers only to loopback Host names: no DNS rebinding); on any other address it requires a token (`?token=` once, then a SameSite cookie, or an
`Authorization: Bearer` header), compared in constant time.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import ipaddress
import json
import re
import secrets
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from agent import records as rec
from agent.report_html import plotly_js, render_body, render_compare_body, render_index, render_page, render_report
from agent.run_view import load_view, run_rows

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
COOKIE = "kloop_token"
POLL_S = 0.5  # how often the stream looks at the record (a stat, no read)
HEARTBEAT_S = 15.0
CSP_LIVE = ("default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
            "font-src data:; connect-src 'self'")
HEADERS = {"Content-Security-Policy": CSP_LIVE, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store", "X-Frame-Options": "DENY"}
INDEX_REFRESH = """<script>
setInterval(function () {
  fetch("index/body", {credentials: "same-origin", cache: "no-store"}).then(function (r) { return r.ok ? r.text() : null; })
    .then(function (h) { if (h !== null) document.getElementById("body").innerHTML = h; });
}, 3000);
</script>"""


@lru_cache(maxsize=1)
def plotly_asset() -> tuple[str, bytes, bytes]:
    """(content hash, the script, the script gzipped): compressed once, named by its hash so that a
    browser may keep it for good (a new bundle is a new name)."""
    data = plotly_js().encode()
    return hashlib.sha256(data).hexdigest()[:16], data, gzip.compress(data, 9)


def plotly_url(prefix: str = "") -> str:
    return f"{prefix}static/plotly-{plotly_asset()[0]}.min.js"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenGate:
    """ASGI middleware: every request must carry the token (query, cookie or bearer header)."""

    def __init__(self, app, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None and secrets.compare_digest(given.encode(), self.token.encode()):
            # set the cookie and drop the token from the address bar (and from any later Referer)
            params = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = "/" + request.url.path.lstrip("/") + ("?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in params) if params else "")
            resp = RedirectResponse(target, status_code=303)
            resp.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return await resp(scope, receive, send)
        cookie = request.cookies.get(COOKIE, "")
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else ""
        if any(v and secrets.compare_digest(v.encode(), self.token.encode()) for v in (cookie, bearer)):
            return await self.app(scope, receive, send)
        resp = PlainTextResponse("kloop serve: this server needs its token (open the address it printed, with ?token=...)\n",
                                 status_code=401)
        return await resp(scope, receive, send)


class LoopbackHostOnly:
    """ASGI middleware for a loopback-bound server: refuse requests whose Host is not a loopback name,
    so a web page cannot read the runs through DNS rebinding."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = Request(scope).headers.get("host", "")
            name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
            if not is_loopback(name):
                return await PlainTextResponse(f"kloop serve answers only to a loopback host name, not {host!r}\n",
                                               status_code=421)(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(runs_root: Path, token: str | None = None) -> Starlette:
    """The app over `runs_root`; with `token`, every request must carry it; without, only loopback Host names are served."""
    root = Path(runs_root)

    def run_dir(request: Request) -> Path:
        run_id = request.path_params["run_id"]
        path = root / run_id
        if not RUN_ID.match(run_id) or not (path / rec.RUN_JSON).is_file():
            raise LookupError(run_id)
        return path

    def html(text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status, headers=HEADERS)

    def not_found(what: str) -> HTMLResponse:
        return html(render_page("kloop: not found", f"<p>no run <code>{_escape(what)}</code> in this folder</p>",
                                plotly_src=plotly_url("/"), csp=CSP_LIVE), 404)

    def index(request: Request) -> Response:
        body = render_index(run_rows(root), str(root))
        page = render_page(f"kloop runs in {root}", body, plotly_src=plotly_url(), csp=CSP_LIVE)
        return html(page.replace("</body>", INDEX_REFRESH + "</body>"))

    def index_body(request: Request) -> Response:
        return html(render_index(run_rows(root), str(root)))

    def run_page(request: Request) -> Response:
        try:
            d = run_dir(request)
            stamp = _stamp(d / rec.EVENTS)  # before reading: a change after it is announced by the stream
            view = load_view(d)
        except (LookupError, rec.RecordError) as exc:
            return not_found(str(exc))
        name = quote(view.run_id)
        live = {"home": "../", "body_url": f"{name}/body", "stream_url": f"{name}/stream", "report": f"{name}/report.html",
                "stamp": stamp}
        return html(render_page(f"kloop {view.run_id}", render_body(view), plotly_src=plotly_url("../"),
                                live=live, csp=CSP_LIVE))

    def run_body(request: Request) -> Response:
        try:
            return html(render_body(load_view(run_dir(request))))
        except (LookupError, rec.RecordError) as exc:
            return html(f"<p class='err'>{_escape(str(exc))}</p>", 404)

    def run_report(request: Request) -> Response:
        try:
            view = load_view(run_dir(request))
        except (LookupError, rec.RecordError) as exc:
            return not_found(str(exc))
        headers = dict(HEADERS, **{"Content-Disposition": f'attachment; filename="kloop-{view.run_id}.html"'})
        headers.pop("Content-Security-Policy")  # the file carries its own (stricter) policy
        return HTMLResponse(render_report(view), headers=headers)

    async def stream(request: Request) -> Response:
        try:
            d = run_dir(request)
        except LookupError as exc:
            return PlainTextResponse(f"no run {exc}", status_code=404)

        async def events():
            last, quiet, last_n, last_ended = None, 0.0, 0, False
            while not await request.is_disconnected():
                stamp = _stamp(d / rec.EVENTS)
                if stamp != last or quiet >= HEARTBEAT_S:
                    s = await asyncio.to_thread(_summary, d) if stamp != last else None
                    data = {"stamp": stamp} | ({"events": s[0], "ended": s[1]} if s else {"events": last_n, "ended": last_ended})
                    last_n, last_ended = data["events"], data["ended"]
                    yield f"event: record\ndata: {json.dumps(data)}\n\n"
                    last, quiet = stamp, 0.0
                await asyncio.sleep(POLL_S)
                quiet += POLL_S

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def compare(request: Request) -> Response:
        ids = [request.query_params.get(k, "") for k in ("a", "b")]
        views = []
        for run_id in ids:
            if not RUN_ID.match(run_id) or not (root / run_id / rec.RUN_JSON).is_file():
                return not_found(run_id)
            try:
                views.append(load_view(root / run_id))
            except rec.RecordError as exc:
                return not_found(str(exc))
        return html(render_page("kloop compare", render_compare_body(views), plotly_src=plotly_url(), csp=CSP_LIVE))

    def plotly(request: Request) -> Response:
        digest, data, packed = plotly_asset()
        if request.path_params["digest"] != digest:
            return PlainTextResponse("no such asset (the page is older than this server: reload it)\n", status_code=404)
        etag = f'"{digest}"'
        headers = {"Cache-Control": "public, max-age=31536000, immutable", "ETag": etag, "Vary": "Accept-Encoding",
                   "X-Content-Type-Options": "nosniff"}
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(packed, media_type="application/javascript", headers=dict(headers, **{"Content-Encoding": "gzip"}))
        return Response(data, media_type="application/javascript", headers=headers)

    routes = [
        Route("/", index), Route("/index/body", index_body), Route("/compare", compare),
        Route("/static/plotly-{digest}.min.js", plotly),
        Route("/runs/{run_id}", run_page), Route("/runs/{run_id}/body", run_body),
        Route("/runs/{run_id}/stream", stream), Route("/runs/{run_id}/report.html", run_report),
    ]
    middleware = [Middleware(TokenGate, token=token)] if token else [Middleware(LoopbackHostOnly)]
    middleware.append(Middleware(GZipMiddleware, minimum_size=1024))  # pages; the SSE stream is left alone
    return Starlette(routes=routes, middleware=middleware)


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def _stamp(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "missing"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _summary(run_dir: Path) -> tuple[int, bool]:
    """(complete events, whether the last session start was followed by an end)."""
    try:
        events, _ = rec.RunRecord.open(run_dir).read()
    except rec.RecordError:
        return 0, False
    ended = False
    for ev in events:
        if ev.kind in ("session_started", "session_ended"):
            ended = ev.kind == "session_ended"
    return len(events), ended


def serve(runs_root: Path, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
          on_ready=None) -> None:
    """Run the app until interrupted. A non-loopback host gets a token (the one given, or a fresh one)."""
    import uvicorn

    if not is_loopback(host) and not token:
        token = secrets.token_urlsafe(24)
    app = create_app(runs_root, token)
    if on_ready:
        on_ready(host, port, token)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
