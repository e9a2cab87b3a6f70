"""Malformed requests against every RPC of both services, generated from the protos (a new RPC or field is
covered without editing this file): no crash, no hang, no INTERNAL, and a legitimate job beside it finishes.

Each request fills the method's input message with hostile values chosen per field type (empty, huge,
NUL-bearing and path-traversing strings; negative and extreme numbers; enum numbers the proto does not
define; long repeated fields; nested messages filled the same way), from a seeded generator, so a failure
reproduces. Client-streaming methods get a stream of such messages.
"""

from __future__ import annotations

import logging
import random

import grpc
import pytest
from google.protobuf import descriptor as _d
from google.protobuf import message_factory

from strop.v1 import export_pb2, trainer_pb2

STRINGS = [
    "",
    " ",
    "../../../etc/passwd",
    "/etc/passwd",
    "a\x00b",
    "x" * 300,
    "y" * 100_000,
    "💥" * 50,
    "sess-doesnotexist",
    "job-doesnotexist",
    "%s%n",
    "{" * 1000,
]
INTS = [0, -1, 1, 7, 2**31 - 1, -(2**31), 2**62]
FLOATS = [0.0, -1.0, 1e308, -1e308, float("nan"), float("inf"), 1e-320]
BYTES = [
    b"",
    b"\x00" * 10,
    b"{not json\n",
    b"\xff\xfe",
    b'{"text": 1}\n' * 3,
    b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",  # nesting past Python's recursion limit
    b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 2,
]
PER_SERVICE = 1200


def _value(fd, rng: random.Random, depth: int):
    if fd.type == _d.FieldDescriptor.TYPE_MESSAGE:
        if fd.message_type.GetOptions().map_entry:
            return None
        sub = message_factory.GetMessageClass(fd.message_type)()
        _fill(sub, rng, depth + 1)
        return sub
    if fd.type == _d.FieldDescriptor.TYPE_ENUM:
        return rng.choice([0, 1, 2, 3, 9, 99, -5])
    if fd.type == _d.FieldDescriptor.TYPE_STRING:
        return rng.choice(STRINGS)
    if fd.type == _d.FieldDescriptor.TYPE_BYTES:
        return rng.choice(BYTES)
    if fd.type == _d.FieldDescriptor.TYPE_BOOL:
        return rng.choice([True, False])
    if fd.type in (_d.FieldDescriptor.TYPE_DOUBLE, _d.FieldDescriptor.TYPE_FLOAT):
        return rng.choice(FLOATS)
    v = rng.choice(INTS)
    if fd.type in (_d.FieldDescriptor.TYPE_UINT32, _d.FieldDescriptor.TYPE_UINT64):
        v = abs(v)
    if fd.type in (
        _d.FieldDescriptor.TYPE_INT32,
        _d.FieldDescriptor.TYPE_UINT32,
        _d.FieldDescriptor.TYPE_SINT32,
    ):
        v = max(-(2**31), min(2**31 - 1, v))
    return v


def _repeated(fd) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED


def _fill(msg, rng: random.Random, depth: int = 0) -> None:
    for fd in msg.DESCRIPTOR.fields:
        if depth > 3 or rng.random() < 0.3:
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            getattr(msg, fd.name).update(
                {rng.choice(STRINGS)[:50]: rng.choice(STRINGS)[:50] for _ in range(3)}
            )
            continue
        if _repeated(fd):
            n = rng.choice([1, 3, 200])
            items = [_value(fd, rng, depth) for _ in range(n)]
            field = getattr(msg, fd.name)
            if fd.type == _d.FieldDescriptor.TYPE_MESSAGE:
                for item in items:
                    field.add().CopyFrom(item)
            else:
                field.extend(items)
            continue
        value = _value(fd, rng, depth)
        if fd.type == _d.FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, fd.name).CopyFrom(value)
        else:
            setattr(msg, fd.name, value)


def _requests(service, rng: random.Random):
    """(method descriptor, request or request list) pairs, cycling over every method of ``service``."""
    methods = list(service.methods)
    for i in range(PER_SERVICE):
        m = methods[i % len(methods)]
        cls = message_factory.GetMessageClass(m.input_type)
        if m.client_streaming:
            # a header first and data after it, as the protocol expects, so the hostile values reach the parsers
            oneof = next(iter(m.input_type.oneofs), None)
            reqs = []
            for k in range(rng.choice([0, 1, 3, 6])):
                r = cls()
                _fill(r, rng)
                if oneof is not None and len(oneof.fields) > 1 and rng.random() < 0.8:
                    keep = oneof.fields[0 if k == 0 else 1]
                    sub = cls()
                    value = getattr(r, keep.name) if r.HasField(keep.name) else _value(keep, rng, 1)
                    if keep.type == _d.FieldDescriptor.TYPE_MESSAGE:
                        getattr(sub, keep.name).CopyFrom(value)
                    else:
                        setattr(sub, keep.name, value)
                    r = sub
                reqs.append(r)
            yield m, reqs
        else:
            r = cls()
            _fill(r, rng)
            yield m, r


def _fuzz(channel, service, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    internal: dict[str, list[str]] = {}
    codes: dict[str, int] = {}
    for m, req in _requests(service, rng):
        path = f"/{service.full_name}/{m.name}"
        in_cls = message_factory.GetMessageClass(m.input_type)
        out_cls = message_factory.GetMessageClass(m.output_type)
        kw = dict(request_serializer=in_cls.SerializeToString, response_deserializer=out_cls.FromString)
        try:
            if m.client_streaming:
                channel.stream_unary(path, **kw)(iter(req), timeout=10)
            elif m.server_streaming:
                call = channel.unary_stream(path, **kw)(req, timeout=10)
                for i, _ in enumerate(call):  # a stream that does start is not followed to its end
                    if i >= 2:
                        call.cancel()
                        break
            else:
                channel.unary_unary(path, **kw)(req, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            if code is grpc.StatusCode.CANCELLED:
                code = grpc.StatusCode.OK  # our own cancel of a started stream
            if code is grpc.StatusCode.INTERNAL:
                internal.setdefault(m.name, []).append(f"{err.details()[:200]} <- {str(req)[:300]!r}")
            assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{m.name} hung on {str(req)[:300]!r}"
        codes[code.name] = codes.get(code.name, 0) + 1
    assert codes.get("UNAVAILABLE", 0) == 0, f"the server went away: {codes}"
    return internal


def test_every_trainer_rpc_survives_malformed_requests_without_internal_errors(trainer, client):
    from strop.demo.data import sft_rows
    from tests.trainer_svc.conftest import FAST_LORA, sft_config

    running, _, _ = trainer
    s = client.load_model("tiny-llama-4bit")
    client.attach_lora(s.session_id, FAST_LORA)
    ds = client.upload_dataset(sft_rows())
    job = next(iter(client.train(s.session_id, ds.dataset_id, sft_config(8)))).job_id  # the legitimate job
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        internal = _fuzz(ch, trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"], seed=1)
    done = client.wait_job(job)
    events = list(client.watch_job(job))
    client.close_session(s.session_id)
    assert not internal, internal
    assert done.state.value == "SUCCEEDED" and done.adapter is not None, done
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "the job's events are intact"


def test_every_export_rpc_survives_malformed_requests_without_internal_errors(model_root, tmp_path):
    from strop.client.export import ExportClient, ExportTarget
    from strop.export_svc.server import ExportConfig, start

    srv = start(ExportConfig(model_root, tmp_path / "artifacts", tmp_path / "state"))
    try:
        with ExportClient(f"127.0.0.1:{srv.port}") as ec:
            exp = ec.create_export(
                [ExportTarget.merged()], base_model_path="tiny-llama"
            )  # the legitimate export
            with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
                internal = _fuzz(ch, export_pb2.DESCRIPTOR.services_by_name["ExportService"], seed=2)
            done = ec.wait_export(exp.export_id)
        assert not internal, internal
        assert done.state.value == "SUCCEEDED" and done.results, done
    finally:
        srv.stop(grace=5.0)


@pytest.mark.parametrize("service", ["TrainerService", "ExportService"])
def test_the_generator_covers_every_method(service):
    desc = (trainer_pb2 if service == "TrainerService" else export_pb2).DESCRIPTOR.services_by_name[service]
    seen = {m.name for m, _ in _requests(desc, random.Random(0))}
    assert seen == {m.name for m in desc.methods}


UNDECODABLE = [
    b"\xff" * 64,
    b"\x0a\xff\xff\xff\xff\x0f",
    b"\x08",
]  # an overlong varint, a cut field, a lone tag


def _raw_calls(channel, service) -> dict[str, grpc.StatusCode]:
    """Every method of ``service`` sent bytes no protobuf message decodes from: as the request of a unary call,
    and as the first and as the second message of a client stream (after a valid empty one)."""
    got = {}
    for m in service.methods:
        path = f"/{service.full_name}/{m.name}"
        for i, garbage in enumerate(UNDECODABLE):
            tries = [[garbage], [b"", garbage]] if m.client_streaming else [garbage]
            for k, req in enumerate(tries):
                try:
                    if m.client_streaming:
                        channel.stream_unary(path)(iter(req), timeout=10)
                    elif m.server_streaming:
                        list(channel.unary_stream(path)(req, timeout=10))
                    else:
                        channel.unary_unary(path)(req, timeout=10)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                got[f"{m.name}[{i}.{k}]"] = code
    return got


def test_undecodable_request_bytes_are_invalid_argument_on_every_rpc(trainer, model_root, tmp_path, caplog):
    # before: UNKNOWN on the unary RPCs, INTERNAL with a logged traceback on the client streams
    from strop.export_svc.server import ExportConfig, start

    running, _, _ = trainer
    srv = start(ExportConfig(model_root, tmp_path / "artifacts", tmp_path / "state"))
    caplog.set_level(logging.WARNING)
    try:
        got = {}
        for port, service in (
            (running.port, trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]),
            (srv.port, export_pb2.DESCRIPTOR.services_by_name["ExportService"]),
        ):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                got.update({f"{service.name}.{k}": v for k, v in _raw_calls(ch, service).items()})
    finally:
        srv.stop(grace=5.0)
    wrong = {k: v.name for k, v in got.items() if v is not grpc.StatusCode.INVALID_ARGUMENT}
    assert not wrong, wrong
    services = [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]]
    services.append(export_pb2.DESCRIPTOR.services_by_name["ExportService"])
    calls = sum(len(UNDECODABLE) * (2 if m.client_streaming else 1) for sv in services for m in sv.methods)
    assert len(got) == calls, "every method of both services was called"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage()[:200] for r in errors]


def test_a_library_message_never_shows_the_server_paths(client, trainer, model_root):
    # before: LoadModel("remote-code") → "…The repository /<model root>/remote-code contains custom code…"
    import json
    import shutil

    from strop.client import InvalidArgumentError

    _, _, config = trainer
    remote = model_root / "remote-code"
    shutil.copytree(model_root / "tiny-llama", remote)
    cfg = json.loads((remote / "config.json").read_text())
    cfg["model_type"] = "strop-custom"  # an architecture only its own code defines
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (remote / "config.json").write_text(json.dumps(cfg))
    try:
        with pytest.raises(InvalidArgumentError) as err:
            client.load_model("remote-code")
    finally:
        shutil.rmtree(remote)
    message = str(err.value)
    assert "custom code" in message or "remote" in message, message
    for private in (model_root, model_root.resolve(), config.artifact_root, config.state_dir):
        assert str(private) not in message, message
