"""deploy/k8s rendered offline (tests/deploy/render.py) and checked against the Kubernetes API schema and the
services' real flags: what must hold in every overlay for the pods to start, stay healthy, drain and be safe."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest

from strop.common.grpc_server import SHUTDOWN_SLACK_S
from tests.deploy.render import RenderError, apply_operation, record_parsed_options, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
README = ROOT / "deploy" / "README.md"
# The API the manifests target: grpc probes' `mode: TLS` (the production overlay) is in this version's schema.
KUBERNETES_VERSION = "1.37.0"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/production"]
# The services' gRPC names (the readiness probes ask for these; the health servicer registers them).
SERVICE_NAMES = {"trainer": "strop.v1.TrainerService", "export": "strop.v1.ExportService"}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """The two services' workloads by service name: the trainer's StatefulSet and the exporter's Deployment."""
    return {"trainer": one(docs, "StatefulSet", "trainer"), "export": one(docs, "Deployment", "export")}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def flag(c: dict, name: str) -> str:
    values = [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"expected --{name}=… once in {c['args']}"
    return values[0]


def env_value(c: dict, name: str) -> dict:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry


def test_every_document_validates_against_the_kubernetes_schema_in_strict_mode(rendered):
    name, docs = rendered
    assert len(docs) >= 12, f"{name}: expected the full set of resources, got {len(docs)}"
    for doc in docs:
        # strict: unknown fields are errors (a misspelt field would otherwise be dropped by the API server)
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_a_misspelt_field(rendered):
    _, docs = rendered
    broken = copy.deepcopy(workloads(docs)["trainer"])
    container(broken)["livenessProbe"]["grpc"]["servce"] = "strop.v1.TrainerService"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_args_are_the_servers_real_flags_and_bind_every_interface(rendered, monkeypatch):
    from strop.export_svc.server import parse_args as export_args
    from strop.trainer_svc.server import parse_args as trainer_args

    options = record_parsed_options(monkeypatch)
    _, docs = rendered
    for svc, parse in (("trainer", trainer_args), ("export", export_args)):
        c = container(workloads(docs)[svc])
        options.clear()
        a = parse(c["args"])  # an unknown flag or a bad value exits (SystemExit) here
        # argparse also accepts unambiguous prefixes (--grac=30); a manifest spells each flag in full
        spelled = {arg.split("=", 1)[0] for arg in c["args"]}
        assert spelled <= options, f"{svc}: {spelled - options} are not the servers' flags as spelled"
        assert a.address.startswith("0.0.0.0:"), f"{svc}: a pod must listen beyond 127.0.0.1, got {a.address}"
        assert a.model_root == "/data/models" and a.artifact_root == "/data/artifacts"
        # each pod its own state dir: $(POD_NAME) is expanded by the kubelet from the env entry of that name
        assert a.state_dir == f"/data/state/{svc}/$(POD_NAME)"
        assert env_value(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_environment_variables_are_ones_the_services_read(rendered):
    _, docs = rendered
    source = "\n".join(p.read_text() for p in (ROOT / "common").glob("*.py"))
    for svc, w in workloads(docs).items():
        for e in container(w)["env"]:
            if e["name"].startswith("STROP_"):
                assert f'"{e["name"]}"' in source, f"{svc}: {e['name']} is read nowhere in common/"


def test_probes_are_grpc_health_on_the_service_port(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        port = int(flag(c, "address").rpartition(":")[2])
        (grpc_port,) = [p for p in c["ports"] if p["name"] == "grpc"]
        assert grpc_port["containerPort"] == port
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c[kind]
            assert set(probe) & {"exec", "httpGet", "tcpSocket"} == set(), f"{svc} {kind}: expected only grpc"
            assert probe["grpc"]["port"] == port, f"{svc} {kind}: expected port {port}, got {probe['grpc']}"
        # readiness asks for the service itself, which goes NOT_SERVING as soon as a drain starts
        assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAMES[svc]


def test_termination_grace_exceeds_the_drain_watchdog(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        grace = float(flag(container(w), "grace"))
        watchdog = 2 * grace + SHUTDOWN_SLACK_S  # common/grpc_server.serve_forever's faulthandler deadline
        period = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert period > watchdog, (
            f"{svc}: SIGKILL at {period}s would cut a drain the watchdog ends at {watchdog}s"
        )


def test_pods_run_non_root_read_only_without_capabilities(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        sc = container(w)["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        # the read-only root needs a writable /tmp (the images point every cache there)
        mounts = {m["mountPath"]: m["name"] for m in container(w)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{svc}: expected an emptyDir at /tmp"


def test_every_container_has_requests_and_limits(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        res = container(w)["resources"]
        for key in ("cpu", "memory"):
            assert key in res["requests"] and key in res["limits"], f"{svc}: expected {key} request and limit"


def test_trainer_requests_one_gpu_and_runs_on_gpu_nodes(rendered):
    _, docs = rendered
    trainer = workloads(docs)["trainer"]
    res = container(trainer)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
    pod = trainer["spec"]["template"]["spec"]
    assert pod["nodeSelector"], "expected a node selector for GPU nodes"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    exporter = workloads(docs)["export"]
    assert "nvidia.com/gpu" not in container(exporter)["resources"]["limits"], "the exporter is CPU only"


def test_each_trainer_pod_is_addressable_through_a_headless_service(rendered):
    _, docs = rendered
    trainer = workloads(docs)["trainer"]
    svc = one(docs, "Service", trainer["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} >= {50051}


def test_exporter_is_a_deployment_scaled_by_an_hpa_behind_a_service(rendered):
    _, docs = rendered
    export = workloads(docs)["export"]
    assert "replicas" not in export["spec"], "the HPA owns the replica count; applying must not reset it"
    hpa = one(docs, "HorizontalPodAutoscaler", "export")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "export"}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    svc = one(docs, "Service", "export")
    assert svc["spec"]["selector"].items() <= export["spec"]["template"]["metadata"]["labels"].items()


def test_shared_volume_is_read_write_many_and_mounted_by_both(rendered):
    _, docs = rendered
    pvc = one(docs, "PersistentVolumeClaim", "strop-data")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for svc, w in workloads(docs).items():
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        claims = {
            n
            for n, v in volumes.items()
            if v.get("persistentVolumeClaim", {}).get("claimName") == "strop-data"
        }
        mounts = [m for m in container(w)["volumeMounts"] if m["name"] in claims]
        assert {m["mountPath"] for m in mounts} == {"/data", "/data/models"}, svc
        assert [m.get("readOnly", False) for m in mounts if m["mountPath"] == "/data/models"] == [True]


def test_disruption_budgets_cover_both_services(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        pdb = one(docs, "PodDisruptionBudget", svc)
        assert (
            pdb["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )


def test_network_policy_denies_by_default_and_opens_the_service_and_metrics_ports(rendered):
    _, docs = rendered
    deny = one(docs, "NetworkPolicy", "default-deny")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    allow = one(docs, "NetworkPolicy", "strop-services")
    (expr,) = allow["spec"]["podSelector"]["matchExpressions"]
    allowed_ports = {p["port"] for rule in allow["spec"]["ingress"] for p in rule["ports"]}
    for svc, w in workloads(docs).items():
        assert w["spec"]["template"]["metadata"]["labels"][expr["key"]] in expr["values"], svc
        exposed = {p["containerPort"] for p in container(w)["ports"]}
        assert exposed <= allowed_ports, f"{svc}: ports {exposed - allowed_ports} are unreachable"


def test_metrics_port_is_exposed_and_annotated_for_prometheus(rendered):
    _, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        port = int(env_value(c, "STROP_METRICS_PORT")["value"])
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(port), svc


def referenced_secrets(docs: list[dict]) -> set[str]:
    names = set()
    for w in workloads(docs).values():
        pod = w["spec"]["template"]["spec"]
        names |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for e in container(w)["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


def test_tokens_and_database_url_come_from_secrets_that_the_readme_creates(rendered):
    name, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        tokens = flag(c, "auth-tokens")
        pod = w["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if tokens.startswith(m["mountPath"] + "/")]
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == "strop-auth", svc
        assert env_value(c, "STROP_DATABASE_URL")["valueFrom"]["secretKeyRef"] == {
            "name": "strop-database",
            "key": "url",
        }
    readme = README.read_text()
    for secret in referenced_secrets(docs):
        assert re.search(rf"kubectl -n strop create secret \S+ {secret}\b", readme), (
            f"{name}: secret {secret} is referenced but deploy/README.md does not say how to create it"
        )


def test_production_serves_tls_and_its_probes_speak_tls(rendered):
    name, docs = rendered
    for svc, w in workloads(docs).items():
        c = container(w)
        tls = any(a.startswith("--tls-cert=") for a in c["args"])
        assert tls == (name == "overlays/production"), f"{name} {svc}: TLS only in production"
        # mTLS would refuse the kubelet's probes (it presents no client certificate)
        assert not any(a.startswith("--tls-client-ca") for a in c["args"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[kind]["grpc"].get("mode", "Plaintext") == ("TLS" if tls else "Plaintext"), (
                f"{svc} {kind}"
            )
        if tls:
            assert "strop-tls" in referenced_secrets(docs)
            assert c["image"].startswith("registry.example.com/strop/"), c["image"]


def test_a_patch_whose_target_is_gone_fails_the_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [r.yaml]\n"
        "patches:\n  - path: p.yaml\n    target: {kind: Deployment, name: renamed}\n"
    )
    (tmp_path / "r.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: export}\nspec: {}\n"
    )
    (tmp_path / "p.yaml").write_text("- {op: add, path: /spec/replicas, value: 2}\n")
    with pytest.raises(RenderError, match="matched 0 resources"):
        render(tmp_path)


def test_json_patch_follows_rfc_6902():
    doc = {"a": [1, 3], "b": {"x/y": 1}}
    apply_operation(doc, {"op": "add", "path": "/a/1", "value": 2})
    apply_operation(doc, {"op": "add", "path": "/a/-", "value": 4})
    apply_operation(doc, {"op": "replace", "path": "/b/x~1y", "value": 5})
    apply_operation(doc, {"op": "add", "path": "/c", "value": {"d": 1}})
    assert doc == {"a": [1, 2, 3, 4], "b": {"x/y": 5}, "c": {"d": 1}}
    with pytest.raises(RenderError):
        apply_operation(doc, {"op": "replace", "path": "/missing", "value": 1})  # replace needs the member
    with pytest.raises(RenderError):
        apply_operation(doc, {"op": "move", "from": "/a", "path": "/z"})  # not used, so not implemented
