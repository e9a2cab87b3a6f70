"""The HTTP gateways' image and the Tinker gateway's manifests, checked offline: the image installs the gateways'
part of the lock without torch (and the gateways import without it), every image copies every package directory
pyproject names, and the rendered Deployment runs the gateway's real flags with plaintext HTTP probes, a drain that
fits its grace period, TLS in production and network access to the trainer alone."""

from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest

from tests.deploy.render import record_parsed_options, render
from tests.deploy.test_images import BUILD_TOOLS, CONTAINERFILES, PYPROJECT, ROOT, names, stages
from tests.deploy.test_manifests import (
    K8S,
    OLDEST_KUBERNETES,
    README,
    SERVICE_KUSTOMIZATIONS,
    VERSION,
    container,
    flag,
    one,
)

GATEWAY_FILE = ROOT / "deploy" / "Containerfile.gateway"
ALL_CONTAINERFILES = {**CONTAINERFILES, "gateway": GATEWAY_FILE}


@pytest.fixture(scope="module", params=SERVICE_KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def tinker(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "tinker")


def package_dirs() -> set[str]:
    """The top-level directories pyproject maps strop's packages to (setuptools refuses a missing one)."""
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    return {d.split("/")[0] for d in dirs}


@pytest.mark.parametrize("role", sorted(ALL_CONTAINERFILES))
def test_every_image_copies_every_package_directory(role):
    builder, _ = stages(ALL_CONTAINERFILES[role].read_text())
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", builder, flags=re.M))
    assert package_dirs() <= copied, f"{role}: `pip install .` fails without {package_dirs() - copied}"


def test_test_deploy_stages_every_package_directory():
    script = (ROOT / "deploy" / "test-deploy.sh").read_text()
    (paths,) = re.findall(r"^PATHS=\((.*)\)$", script, flags=re.M)
    assert package_dirs() <= set(paths.split())
    assert 'GATEWAY_IMAGE="localhost/strop-gateway:$TAG"' in script
    assert 'build gateway gateway "$GATEWAY_IMAGE"\n' in script, "no torch arguments: the image has none"


def test_gateway_image_installs_the_gateways_part_of_the_lock_without_torch():
    gw = names(["tinker", "openai"], torch=False)
    assert {"tinker", "openai", "fastapi", "uvicorn", "zstandard", "grpcio", "protobuf"} <= gw
    heavy = {"torch", "triton", "bitsandbytes", "peft", "trl", "accelerate", "llama-cpp-python", "gguf"}
    assert gw & heavy == set(), f"the gateway image would pull {gw & heavy}"
    assert gw & {"pytest", "ruff", "grpcio-tools", "kubernetes-validate"} == set()
    builder, _ = stages(GATEWAY_FILE.read_text())
    assert (
        "deploy/lock_subset.py requirements/lock.txt pyproject.toml --extra tinker --extra openai --no-torch"
        in builder
    )
    assert "--also setuptools" in builder, "strop's build backend (only torch pulls it in otherwise)"
    assert "pip install -q --no-deps --require-hashes -r" in builder and "pip check" in builder
    assert "torch" not in " ".join(re.findall(r"pip install[^\n]*", builder)).replace("--no-torch", "")


def test_the_gateways_import_without_torch():
    # what the image's Python does: torch absent (an import of it fails), and nothing that needs it is loaded
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import strop.cli.main, strop.gateways.tinker.app, strop.gateways.tinker.server, strop.gateways.health\n"
        "from strop.gateways.tinker.gateway import Gateway, GatewayConfig\n"
        "Gateway(GatewayConfig()).close()\n"
        "print(sorted(m for m in ('transformers', 'triton', 'peft', 'safetensors') if sys.modules.get(m)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_gateway_containerfile_runs_strop_serve_as_a_numeric_non_root_user_without_build_tools():
    text = GATEWAY_FILE.read_text()
    assert re.findall(r"^FROM (\S+)", text, flags=re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, flags=re.M)
    assert base == "docker.io/library/debian:bookworm-slim"
    _, final = stages(text)
    assert "COPY --from=builder /opt/strop /opt/strop" in final
    assert re.findall(r"^USER (\d+):(\d+)$", final, flags=re.M) == [("10001", "10001")]
    assert re.findall(r"^ENTRYPOINT (.+)$", final, flags=re.M) == ['["/opt/strop/bin/strop", "serve"]']
    installs = " ".join(re.findall(r"apt-get install[^;]*", final))
    assert not [t for t in (*BUILD_TOOLS, "gcc") if t in installs + " "], installs
    assert "HF_HUB_OFFLINE=1" in final and "HF_HOME=/tmp/" in final


def test_tinker_args_are_the_gateways_real_flags(rendered, monkeypatch):
    from strop.gateways.tinker.server import build_parser

    options = record_parsed_options(monkeypatch)
    name, docs = rendered
    c = container(tinker(docs))
    assert c["args"][0] == "tinker", (
        "the image's entrypoint is `strop serve`: the first argument picks the gateway"
    )
    a = build_parser().parse_args(c["args"][1:])  # an unknown flag exits here
    spelled = {arg.split("=", 1)[0] for arg in c["args"][1:]}
    assert spelled <= options, f"{spelled - options} are not the gateway's flags as spelled"
    assert a.listen.startswith("0.0.0.0:") and a.model_root == "/data/models"
    # trainer-0 holds the shared bases and every run on them (sessions live on one pod's GPU)
    trainer = one(docs, "StatefulSet", "trainer")
    assert (
        a.trainer
        == f"{trainer['metadata']['name']}-0.{trainer['spec']['serviceName']}.strop.svc.cluster.local:50051"
    )
    assert (a.tls_cert is not None) == (a.tls_key is not None) == (name == "overlays/production")
    assert (a.trainer_tls_ca is not None) == (name == "overlays/production"), (
        "TLS to the trainer where it serves TLS"
    )
    # the admin token (loads each base once as a shared session) comes from a secret README says how to create
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in tinker(docs)["spec"]["template"]["spec"]["volumes"]}
    for path in filter(None, (a.admin_token_file, a.tls_cert, a.trainer_tls_ca)):
        secret = vols[mounts[path.rsplit("/", 1)[0]]]["secret"]["secretName"]
        assert re.search(rf"kubectl -n strop create secret \S+ {secret}\b", README.read_text()), secret


def test_tinker_probes_are_plaintext_http_on_the_health_port(rendered):
    _, docs = rendered
    c = container(tinker(docs))
    port = int(flag(c, "listen").rpartition(":")[2])
    health = int(flag(c, "health-port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": port, "health": health} and health != port
    for kind, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        probe = c[kind]
        assert set(probe) & {"exec", "grpc", "tcpSocket"} == set(), kind
        # scheme HTTP (the default): the health port is plaintext whatever --listen speaks
        assert probe["httpGet"] == {"path": path, "port": health}, f"{kind}: {probe['httpGet']}"


def test_tinker_drains_within_its_grace_period(rendered):
    from strop.gateways.tinker.server import build_parser

    _, docs = rendered
    w = tinker(docs)
    c = container(w)
    a = build_parser().parse_args(c["args"][1:])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # uvicorn's graceful shutdown (gateways/common.serve: 10 s) after the preStop sleep, a long poll (--poll-ms) at most
    period = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > pre_stop + 10 + a.poll_ms / 1000, period


def test_tinker_pods_are_restricted_and_read_only(rendered):
    _, docs = rendered
    w = tinker(docs)
    pod, c = w["spec"]["template"]["spec"], container(w)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] == 10001
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]["name"]]
    assert mounts["/data/models"]["readOnly"] is True and "/data" not in mounts, (
        "it reads the model root only"
    )
    for key in ("cpu", "memory"):
        assert key in c["resources"]["requests"] and key in c["resources"]["limits"]
    pdb = one(docs, "PodDisruptionBudget", "tinker")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    svc = one(docs, "Service", "tinker")
    assert svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [int(flag(c, "listen").rpartition(":")[2])]


def test_tinker_network_access_is_clients_in_and_the_trainer_and_dns_out(rendered):
    _, docs = rendered
    w = tinker(docs)
    labels = w["spec"]["template"]["metadata"]["labels"]
    c = container(w)
    pol = one(docs, "NetworkPolicy", "strop-gateways")
    (expr,) = pol["spec"]["podSelector"]["matchExpressions"]
    assert labels[expr["key"]] in expr["values"]
    ingress_ports = {p["port"] for r in pol["spec"]["ingress"] for p in r["ports"]}
    assert ingress_ports == {int(flag(c, "listen").rpartition(":")[2])}, (
        "the health port is the kubelet's only"
    )
    egress = pol["spec"]["egress"]
    assert all(r.get("to") for r in egress), "no egress rule open to every address"
    by_port = {frozenset(p["port"] for p in r["ports"]): r for r in egress}
    assert set(by_port) == {frozenset({50051}), frozenset({53})}
    trainer_labels = one(docs, "StatefulSet", "trainer")["spec"]["template"]["metadata"]["labels"]
    (peer,) = by_port[frozenset({50051})]["to"]
    assert peer["podSelector"]["matchLabels"].items() <= trainer_labels.items()
    # and the trainer lets the gateway in (the services' own policy admits strop.dev/client pods only)
    back = one(docs, "NetworkPolicy", "strop-trainer-from-gateways")
    assert back["spec"]["podSelector"]["matchLabels"].items() <= trainer_labels.items()
    (rule,) = back["spec"]["ingress"]
    (src,) = rule["from"]
    (sel,) = src["podSelector"]["matchExpressions"]
    assert labels[sel["key"]] in sel["values"] and [p["port"] for p in rule["ports"]] == [50051]
    assert "strop.dev/client" not in labels, "that label would open the exporter to the gateway too"


def test_gateway_image_names_follow_the_overlays(rendered):
    name, docs = rendered
    image = container(tinker(docs))["image"]
    want = "localhost/strop-gateway" if name == "overlays/dev" else "registry.example.com/strop/gateway"
    assert image == f"{want}:{VERSION}"
    for doc in (tinker(docs), one(docs, "NetworkPolicy", "strop-gateways")):
        kubernetes_validate.validate(doc, OLDEST_KUBERNETES, strict=True)
