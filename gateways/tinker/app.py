"""The HTTP surface (Starlette via FastAPI): thin routes that parse the SDK's own request models, call
:class:`~strop.gateways.tinker.gateway.Gateway` off the event loop and serialise the SDK's own response models.

Errors: a :class:`WireError` is its HTTP status with ``{"detail": …}`` (the SDK's ``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``RateLimitError`` …); a malformed body is 400. A failure found once a
future runs is a 200 ``{"error", "category"}`` from ``retrieve_future`` (the SDK's ``RequestFailedError``).
"""

from __future__ import annotations

import functools
import logging

import anyio
import pydantic
import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as tt

from strop.gateways.tinker.gateway import Gateway
from strop.gateways.tinker.wire import WireError

log = logging.getLogger("strop.gateways.tinker")
MAX_BODY = 256 << 20  # a forward_backward chunk is ≤ 5 MB by the client config; zstd output is bounded too


def _json(model: pydantic.BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=True), status_code=status)


def create_app(gw: Gateway, *, threads: int = 256) -> FastAPI:
    app = FastAPI(title="strop: Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    limiter = anyio.CapacityLimiter(threads)  # long polls hold a thread each

    async def run(fn, *args):
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)

    @app.exception_handler(WireError)
    async def _wire_error(_req, exc: WireError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):  # a bug of ours: logged, answered with a body (never bare)
        log.exception("unexpected error")
        return JSONResponse(
            {"detail": f"internal error: {type(exc).__name__}: {exc}"},
            status_code=500,
            headers={"x-should-retry": "false"},  # the same request would fail the same way
        )

    def key(req: Request) -> str:
        k = req.headers.get("x-api-key")
        gw.owner_of(k)  # 401 when missing or malformed
        return k

    async def body(req: Request, cls):
        key(req)  # 401 before any parsing
        raw = await req.body()
        try:
            return cls.model_validate_json(raw or b"{}")
        except pydantic.ValidationError as exc:
            errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            raise WireError(f"bad {cls.__name__}: {errs}") from None

    v1 = "/api/v1"

    # ---- service
    @app.get(f"{v1}/healthz")
    async def healthz():
        return _json(tt.HealthResponse(status="ok"))

    @app.post(f"{v1}/client/config")
    async def client_config(req: Request):
        key(req)
        # the defaults, zstd-compressed forward_backward bodies on, every optional feature off (tinker-wire.md §3)
        return _json(
            tt.ClientConfigResponse(
                proto_compress_fwdbwd=True, fwdbwd_max_chunk_len=gw.config.max_chunk_datums
            )
        )

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities(req: Request):
        key(req)
        return _json(await run(gw.capabilities))

    @app.post(f"{v1}/create_session")
    async def create_session(req: Request):
        await body(req, tt.CreateSessionRequest)
        return _json(gw.create_session(key(req)))

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(req: Request):
        b = await body(req, tt.SessionHeartbeatRequest)
        gw.heartbeat(key(req), b.session_id)
        return _json(tt.SessionHeartbeatResponse())

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, req: Request):
        gw.heartbeat(key(req), session_id)
        return JSONResponse({})

    @app.post(f"{v1}/telemetry")
    async def telemetry(req: Request):
        key(req)
        await req.body()  # accepted and dropped
        return _json(tt.TelemetryResponse(status="accepted"))

    # ---- models and training
    @app.post(f"{v1}/create_model")
    async def create_model(req: Request):
        return _json(await run(gw.create_model, key(req), await body(req, tt.CreateModelRequest)))

    @app.post(f"{v1}/get_info")
    async def get_info(req: Request):
        b = await body(req, tt.GetInfoRequest)
        return _json(gw.get_info(key(req), b.model_id))

    @app.post(f"{v1}/unload_model")
    async def unload_model(req: Request):
        b = await body(req, tt.UnloadModelRequest)
        await run(gw.unload_model, key(req), b.model_id)
        return _json(tt.UnloadModelResponse(model_id=b.model_id))

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(req: Request):
        k = key(req)
        raw = await req.body()
        if req.headers.get("content-encoding", "").lower() == "zstd":
            try:
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_BODY)
            except zstandard.ZstdError as exc:
                raise WireError(f"the zstd body does not decompress: {exc}") from None
        if "protobuf" not in req.headers.get("content-type", ""):
            raise WireError(
                "forward_backward takes application/x-protobuf (the SDK's ForwardBackwardRequest)", 415
            )
        return _json(await run(gw.forward_backward, k, raw))

    @app.post(f"{v1}/optim_step")
    async def optim_step(req: Request):
        return _json(await run(gw.optim_step, key(req), await body(req, tt.OptimStepRequest)))

    # ---- weights
    @app.post(f"{v1}/save_weights")
    async def save_weights(req: Request):
        return _json(await run(gw.save_weights, key(req), await body(req, tt.SaveWeightsRequest)))

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_weights_for_sampler(req: Request):
        b = await body(req, tt.SaveWeightsForSamplerRequest)
        return _json(await run(gw.save_weights_for_sampler, key(req), b))

    @app.post(f"{v1}/load_weights")
    async def load_weights(req: Request):
        return _json(await run(gw.load_weights, key(req), await body(req, tt.LoadWeightsRequest)))

    @app.post(f"{v1}/weights_info")
    async def weights_info(req: Request):
        raw = await req.json() if await req.body() else {}
        path = raw.get("tinker_path") if isinstance(raw, dict) else None
        if not isinstance(path, str):
            raise WireError("weights_info needs tinker_path")
        return _json(await run(gw.weights_info, key(req), path))

    # ---- sampling
    @app.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(req: Request):
        b = await body(req, tt.CreateSamplingSessionRequest)
        return _json(await run(gw.create_sampling_session, key(req), b))

    @app.get(f"{v1}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, req: Request):
        return _json(gw.get_sampler(key(req), sampler_id))

    @app.post(f"{v1}/asample")
    async def asample(req: Request):
        return _json(await run(gw.sample, key(req), await body(req, tt.SampleRequest)))

    # ---- futures
    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(req: Request):
        b = await body(req, tt.FutureRetrieveRequest)
        out = await run(gw.retrieve, key(req), b.request_id)
        if out is None:
            return JSONResponse({"type": "try_again", "request_id": b.request_id, "queue_state": "active"})
        if isinstance(out, bytes):
            return Response(out, media_type="application/x-protobuf")
        return _json(out)

    # ---- REST: runs and checkpoints
    @app.get(f"{v1}/training_runs")
    async def training_runs(req: Request, limit: int = 20, offset: int = 0):
        if limit < 0 or offset < 0:
            raise WireError("limit and offset must be >= 0")
        return _json(await run(gw.training_runs, key(req), limit, offset))

    @app.get(f"{v1}/training_runs/{{model_id}}")
    async def training_run(model_id: str, req: Request):
        return _json(await run(gw.training_run, key(req), model_id))

    @app.get(f"{v1}/training_runs/{{model_id}}/checkpoints")
    async def checkpoints(model_id: str, req: Request):
        return _json(await run(gw.list_checkpoints, key(req), model_id))

    @app.delete(f"{v1}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, req: Request):
        await run(gw.delete_checkpoint, key(req), model_id, checkpoint_id)
        return Response(status_code=204)

    return app
