"""Authentication and transport security of both services: bearer tokens, TLS and mTLS.

Certificates are generated here (a throwaway CA, a server certificate for 127.0.0.1, a client certificate).
"""

from __future__ import annotations

import datetime
import ipaddress
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strop.client import TrainerClient, UnauthenticatedError, UnavailableError
from strop.common.auth import TokenTable
from strop.common.grpc_server import Security
from strop.trainer_svc.core.trainer_core import TrainerConfig
from strop.trainer_svc.server import start


def _pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, key, cert):
        (tmp_path / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        (tmp_path / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("strop test CA"))
        .issuer_name(name("strop test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca_key, ca)
    for stem, san in (("server", x509.IPAddress(ipaddress.ip_address("127.0.0.1"))), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(stem))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName([san]), critical=False)
        write(stem, key, builder.sign(ca_key, hashes.SHA256()))
    return tmp_path


def _tokens(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(
        json.dumps(
            {
                "tokens": [
                    {"tenant": "team-a", "token": "token-a"},
                    {"tenant": "team-b", "token": "token-b"},
                    {"tenant": "ops", "token": "token-ops", "role": "admin"},
                ]
            }
        )
    )
    return path


def _service(model_root, tmp_path, security):
    config = TrainerConfig(model_root=model_root, artifact_root=tmp_path / "a", state_dir=tmp_path / "s")
    return start(config, security=security)


def test_calls_need_a_known_bearer_token_and_health_needs_none(model_root, tmp_path):
    svc = _service(model_root, tmp_path, Security(tokens=TokenTable.load(_tokens(tmp_path))))
    target = f"127.0.0.1:{svc.port}"
    try:
        with (
            TrainerClient(target) as anonymous,
            pytest.raises(UnauthenticatedError, match="needs a bearer token"),
        ):
            anonymous.list_sessions()
        with (
            TrainerClient(target, token="not-a-token") as wrong,
            pytest.raises(UnauthenticatedError, match="unknown"),
        ):
            wrong.list_jobs()
        with TrainerClient(target, token="token-a") as ok:
            assert ok.list_sessions() == []
        with grpc.insecure_channel(target) as ch:  # probes carry no token
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.stop(grace=2.0)


def test_a_token_file_that_is_not_one_is_refused(tmp_path):
    from strop.common.errors import InvalidArgument

    bad = tmp_path / "bad.json"
    bad.write_text('{"tokens": [{"tenant": "", "token": "x"}]}')
    with pytest.raises(InvalidArgument, match="bad entry"):
        TokenTable.load(bad)


def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(model_root, tmp_path):
    pki = _pki(tmp_path)
    security = Security.from_files(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    svc = _service(model_root, tmp_path, security)
    target = f"127.0.0.1:{svc.port}"
    try:
        with TrainerClient(target, tls_ca=pki / "ca.pem") as tls:
            assert tls.list_sessions() == []
        with TrainerClient(target, timeout=3) as plain, pytest.raises(UnavailableError):
            plain.list_sessions()
    finally:
        svc.stop(grace=2.0)


def test_mtls_needs_a_client_certificate_signed_by_the_configured_ca(model_root, tmp_path):
    pki = _pki(tmp_path)
    security = Security.from_files(
        tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem")
    )
    svc = _service(model_root, tmp_path, security)
    target = f"127.0.0.1:{svc.port}"
    try:
        with TrainerClient(
            target, tls_ca=pki / "ca.pem", tls_cert=pki / "client.pem", tls_key=pki / "client.key"
        ) as mtls:
            assert mtls.list_sessions() == []
        with (
            TrainerClient(target, tls_ca=pki / "ca.pem", timeout=3) as no_cert,
            pytest.raises(UnavailableError),
        ):
            no_cert.list_sessions()
    finally:
        svc.stop(grace=2.0)


def test_under_mtls_probes_reach_health_alone_on_the_plaintext_health_port(model_root, tmp_path):
    """Kubernetes' gRPC probes present no client certificate: --health-port serves grpc.health.v1 alone,
    in plaintext, with the service's own statuses; nothing else answers there."""
    from strop.v1 import trainer_pb2, trainer_pb2_grpc

    pki = _pki(tmp_path)
    security = Security.from_files(
        tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem")
    )
    (tmp_path / "data").mkdir(exist_ok=True)
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=tmp_path / "a",
        state_dir=tmp_path / "s",
        data_root=tmp_path / "data",
    )
    svc = start(config, security=security, health="127.0.0.1:0")
    port = svc.running.health_port
    assert port and port != svc.port
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "strop.v1.TrainerService"):
                resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                trainer_pb2_grpc.TrainerServiceStub(ch).ListSessions(
                    trainer_pb2.ListSessionsRequest(), timeout=5
                )
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED, "the API is not on the probe port"
        svc.running.drain.start()
        svc.running._loop.run(svc.running.health.enter_graceful_shutdown())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING, (
                "draining shows on the probe port"
            )
    finally:
        svc.stop(grace=2.0)
