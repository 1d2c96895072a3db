"""The FastAPI app: each API's routes (openai_api, responses, anthropic, infill), the server's
own (/health, /v1/models, /metrics, /v1/dashboard, the web page), errors in the shape of the API
called, and the HTTP guard (key, limits, CORS)."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic import add_anthropic_routes
from .dashboard import dashboard
from .frontend import Frontend
from .http_errors import RETRY_AFTER_S, APIError, ClientGone, error_body, error_response
from .http_guard import HttpLimits
from .infill import add_infill_routes
from .openai_api import add_openai_routes
from .responses import add_responses_routes

log = logging.getLogger("hetserve.api")

WEB_DIR = Path(__file__).parent / "web"  # the page at / (no API key: it holds no data; its calls need one)


def build_app(frontend: Frontend, api_key: str | None = None, max_body_bytes: int = 4 << 20,
              lifespan=None, http_limits: HttpLimits | None = None) -> FastAPI:
    app = FastAPI(title="hetserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    fe = frontend

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        # OpenAI and vLLM answer a malformed body with 400 (the openai client's BadRequestError),
        # not pydantic's 422.
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return error_response(400, f"invalid request: {where or 'body'}: {msg}", where, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), path=request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, _):
        log.info("client left before its answer: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return error_response(500, "internal server error", path=request.url.path)

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """200 while any worker serves (a dead one only leaves the routing), else 503; the body
        lists every worker's state."""
        body = fe.health()
        if fe.healthy:
            return JSONResponse(body)
        body["error"] = error_body(503, "draining" if fe.draining else "no worker is serving")["error"]
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/", include_in_schema=False)
    async def web_page():
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():  # what a client asks for without reading the page's <link rel="icon">
        return FileResponse(WEB_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=WEB_DIR, check_dir=False), name="static")

    @app.get("/v1/dashboard")
    async def live_dashboard():
        """The web page's live view: workers, recent routing decisions, latency percentiles."""
        return dashboard(fe)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": 0,
                                            "owned_by": "hetserve", "max_model_len": fe.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(fe.metrics.render(), media_type="text/plain; version=0.0.4")

    add_openai_routes(app, fe)
    add_responses_routes(app, fe)
    add_infill_routes(app, fe)
    add_anthropic_routes(app, fe)
    (http_limits or HttpLimits()).install(app, api_key, max_body_bytes)  # auth, body cap, CORS, origins
    return app
