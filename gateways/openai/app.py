"""The HTTP surface (Starlette via FastAPI): thin routes under ``/v1`` that call
:class:`~strop.gateways.openai.gateway.Gateway` off the event loop and serialise the ``openai`` SDK's own models.

Errors are OpenAI's error object (``errors.OpenAIError``); a malformed body is 400, an unknown route 404, a wrong
method 405, each with that object, never a bare 500 for what a caller sent.
"""

from __future__ import annotations

import functools
import json
import logging

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from strop.gateways.openai.errors import OpenAIError, bad
from strop.gateways.openai.gateway import Gateway

log = logging.getLogger("strop.gateways.openai")


def _out(value) -> JSONResponse:
    def plain(v):
        if isinstance(v, pydantic.BaseModel):
            return v.model_dump(mode="json", exclude_none=False)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return JSONResponse(plain(value))


def _key(req: Request) -> str | None:
    auth = req.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _int(req: Request, name: str, default: int) -> int:
    raw = req.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise bad(f"'{name}' must be an integer, got {raw!r}", name) from None


def create_app(gw: Gateway, *, threads: int = 64) -> FastAPI:
    app = FastAPI(title="strop: OpenAI fine-tuning API", docs_url=None, redoc_url=None, openapi_url=None)
    limiter = anyio.CapacityLimiter(threads)

    async def run(fn, *args):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_req, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(HTTPException)
    async def _http_error(_req, exc: HTTPException):
        err = OpenAIError(str(exc.detail), exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        return JSONResponse(bad(f"bad request: {exc.errors()[:3]}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):  # a bug of ours: logged, answered with OpenAI's object
        log.exception("unexpected error")
        err = OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500, code="server_error")
        return JSONResponse(err.body(), status_code=500, headers={"x-should-retry": "false"})

    async def json_body(req: Request):
        raw = await req.body()
        try:
            return json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None

    @app.get("/healthz")
    async def healthz():
        return JSONResponse({"status": "ok"})

    # ---- files
    @app.post("/v1/files")
    async def create_file(req: Request):
        key = _key(req)
        await run(gw.owner, key)  # 401 before reading the upload
        if "multipart/form-data" not in req.headers.get("content-type", ""):
            raise bad("POST /v1/files takes multipart/form-data with 'file' and 'purpose'")
        try:
            form = await req.form()
        except Exception as exc:  # a malformed multipart body (python-multipart's errors)
            raise bad(f"the multipart body does not parse: {exc}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise bad(
                "Missing required parameter: 'file' (a file part)", "file", "missing_required_parameter"
            )
        if not isinstance(purpose, str):
            raise bad("Missing required parameter: 'purpose'", "purpose", "missing_required_parameter")
        data = await upload.read()
        return _out(await run(gw.files.create, key, upload.filename or "upload.jsonl", purpose, data))

    @app.get("/v1/files")
    async def list_files(req: Request):
        q = req.query_params
        page = await run(
            gw.files.list,
            _key(req),
            q.get("purpose"),
            q.get("after"),
            _int(req, "limit", 10_000),
            q.get("order", "desc"),
        )
        return _out(page)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, req: Request):
        return _out(gw.files.wire(await run(gw.files.doc, _key(req), file_id)))

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, req: Request):
        return _out(await run(gw.files.delete, _key(req), file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, req: Request):
        return Response(
            await run(gw.files.content, _key(req), file_id), media_type="application/octet-stream"
        )

    # ---- fine-tuning jobs
    @app.post("/v1/fine_tuning/jobs")
    async def create_job(req: Request):
        key = _key(req)
        await run(gw.owner, key)
        return _out(await run(gw.create_job, key, await json_body(req)))

    @app.get("/v1/fine_tuning/jobs")
    async def list_jobs(req: Request):
        q = req.query_params
        meta = {
            k[len("metadata[") : -1]: v for k, v in q.items() if k.startswith("metadata[") and k.endswith("]")
        }
        return _out(await run(gw.list_jobs, _key(req), q.get("after"), _int(req, "limit", 20), meta))

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    async def retrieve_job(job_id: str, req: Request):
        key = _key(req)
        return _out(gw.job_wire(await run(gw.job, key, job_id)))

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str, req: Request):
        return _out(await run(gw.cancel_job, _key(req), job_id))

    @app.post("/v1/fine_tuning/jobs/{job_id}/pause")
    async def pause_job(job_id: str, req: Request):
        return _out(await run(gw.pause_job, _key(req), job_id))

    @app.post("/v1/fine_tuning/jobs/{job_id}/resume")
    async def resume_job(job_id: str, req: Request):
        return _out(await run(gw.resume_job, _key(req), job_id))

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def job_events(job_id: str, req: Request):
        q = req.query_params
        return _out(await run(gw.events, _key(req), job_id, q.get("after"), _int(req, "limit", 20)))

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def job_checkpoints(job_id: str, req: Request):
        q = req.query_params
        return _out(await run(gw.checkpoints, _key(req), job_id, q.get("after"), _int(req, "limit", 10)))

    # ---- models (a fine-tuned model's name holds '/' when its base does: the path converter keeps it whole)
    @app.get("/v1/models")
    async def list_models(req: Request):
        return _out(await run(gw.models, _key(req)))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, req: Request):
        return _out(await run(gw.model, _key(req), model))

    @app.delete("/v1/models/{model:path}")
    async def delete_model(model: str, req: Request):
        return _out(await run(gw.delete_model, _key(req), model))

    return app
