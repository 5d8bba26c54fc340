"""FastAPI and Litestar with the peers' conventions, for
tests/web/test_conventions_servers.py (uvicorn): limit strings, header profiles,
on_refusal, exempt. ``fastapi_app`` and ``litestar_app``."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from litestar import Litestar, get
from litestar import Response as LitestarResponse
from starlette.responses import JSONResponse

from bucketlimit import fastapi as bl_fastapi
from bucketlimit import litestar as bl_litestar
from bucketlimit.web import Refusal

PROFILES = ["draft-11", "legacy", "openai"]


def starlette_custom(request: Any, refusal: Refusal) -> JSONResponse:
    return JSONResponse({"custom": True, "path": request.url.path}, status_code=refusal.status)


fastapi_app = FastAPI()
fastapi_app.add_middleware(
    bl_fastapi.RateLimitMiddleware,
    limit=bl_fastapi.Limit("1000/minute", name="app"),
    headers=PROFILES,
)
models_limit = bl_fastapi.Limit("2/minute", name="requests", headers=PROFILES)
custom_limit = bl_fastapi.Limit("1/minute", name="custom", on_refusal=starlette_custom)


@fastapi_app.get("/health")
@bl_fastapi.exempt
async def health() -> str:
    return "ok"


@fastapi_app.get("/v1/models", dependencies=[Depends(models_limit)])
async def models() -> dict[str, Any]:
    return {"object": "list", "data": []}


@fastapi_app.get("/custom", dependencies=[Depends(custom_limit)])
async def custom() -> str:
    return "once"


def litestar_custom(request: Any, refusal: Refusal) -> LitestarResponse[dict[str, Any]]:
    return LitestarResponse({"custom": True, "path": request.url.path}, status_code=refusal.status)


ls_models = bl_litestar.Limit("2/minute", name="requests", headers=PROFILES)
ls_custom = bl_litestar.Limit("1/minute", name="custom", on_refusal=litestar_custom)


@get("/health")
async def ls_health() -> str:
    return "ok"


@get("/v1/models", middleware=[ls_models.middleware])
async def ls_models_route() -> dict[str, Any]:
    return {"object": "list", "data": []}


@get("/custom", middleware=[ls_custom.middleware])
async def ls_custom_route() -> str:
    return "once"


litestar_app = Litestar(
    [ls_health, ls_models_route, ls_custom_route],
    on_startup=[ls_models.check_store, ls_custom.check_store],
)
