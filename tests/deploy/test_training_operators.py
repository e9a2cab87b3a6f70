"""deploy/k8s/training-operators: a Kubeflow Trainer v2 TrainJob and a PyTorchJob running the dist worker, checked
offline against the two CRDs' own OpenAPI v3 schemas (vendored in crd_schemas/, see its README) and against the
worker itself: its argument parser, the environment it reads, and what each operator injects into the pods."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from strop.common import serde
from strop.common.trainer_types import JobState
from strop.trainer_svc import dist_worker
from strop.trainer_svc.core.dist_launch import DistributedJob
from tests.deploy.render import record_parsed_options, render
from tests.deploy.test_manifests import KUBERNETES_VERSION, OLDEST_KUBERNETES

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "deploy" / "k8s" / "training-operators"
SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
FILES = ["job-spec/job-spec.yaml", "trainjob/trainjob.yaml", "pytorchjob/pytorchjob.yaml"]
JOBS = {"TrainJob": "trainjob", "PyTorchJob": "pytorchjob"}  # each a kustomization: the job-spec and the job
CRDS = {  # (apiVersion, kind) -> the vendored openAPIV3Schema of that CRD version
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.v1alpha1.json",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.json",
}
ROOT_METADATA = {
    "name",
    "namespace",
    "labels",
    "annotations",
}  # the root `metadata` is ObjectMeta, opaque in a CRD
WORKER_MODULE = ["/opt/strop/bin/python", "-m", "strop.trainer_svc.dist_worker"]
TRAINJOB_MASTER_PORT = "29500"  # kubeflow/trainer pkg/constants: ContainerTrainerPort
# The dist worker's image paths: the PVC at /data, the job spec from the ConfigMap.
EXPECTED_ROOTS = {
    "model_root": "/data/models",
    "artifact_root": "/data/artifacts",
    "data_root": "/data/datasets",
    "work_dir": "/tmp/work",
}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DIR / name).read_text()) if d]


def all_docs() -> list[dict]:
    return [d for f in FILES for d in load(f)]


def one(kind: str) -> dict:
    (doc,) = [d for d in all_docs() if d["kind"] == kind]
    return doc


def schema_for(doc: dict) -> dict:
    return json.loads((SCHEMAS / CRDS[(doc["apiVersion"], doc["kind"])]).read_text())


def unknown_fields(schema: dict, value: Any, path: str = "") -> list[str]:
    """Every key path of ``value`` that ``schema`` does not declare (what the API server would prune silently from
    a structural CRD), and every duplicate key of an ``x-kubernetes-list-type: map`` list (what it would refuse)."""
    found: list[str] = []
    if isinstance(value, dict):
        if path == ".metadata":
            return [f"{path}.{k}" for k in value if k not in ROOT_METADATA]
        if "properties" in schema:
            for k, v in value.items():
                if k in schema["properties"]:
                    found += unknown_fields(schema["properties"][k], v, f"{path}.{k}")
                else:
                    found.append(f"{path}.{k}")
        elif isinstance(schema.get("additionalProperties"), dict):
            for k, v in value.items():
                found += unknown_fields(schema["additionalProperties"], v, f"{path}.{k}")
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            found += [f"{path}.{k}" for k in value]  # an object that declares no field keeps none
    elif isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
            found += [f"{path}: duplicate list-map key {k}" for k in {k for k in keys if keys.count(k) > 1}]
        for i, item in enumerate(value):
            found += unknown_fields(schema.get("items", {}), item, f"{path}[{i}]")
    return found


def check_crd(doc: dict) -> None:
    schema = schema_for(doc)
    jsonschema.Draft7Validator(schema).validate(doc)  # types, enums, required, bounds (CEL rules are not run)
    assert unknown_fields(schema, doc) == [], f"{doc['kind']}: fields the CRD does not declare"


def pods(doc: dict) -> dict[str, dict]:
    """The pod templates a job's operator starts, by role: the PyTorchJob's replica templates as written; for the
    TrainJob, the runtimePatches' pod template with the `trainer` fields folded into its `node` container (what
    the torch-distributed runtime does with them)."""
    if doc["kind"] == "PyTorchJob":
        return {role: r["template"] for role, r in doc["spec"]["pytorchReplicaSpecs"].items()}
    (patch,) = doc["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node", "the torch-distributed runtime's replicated job is `node`"
    template = copy.deepcopy(job["template"]["spec"]["template"])
    (c,) = template["spec"]["containers"]
    assert c["name"] == "node", "the torch-distributed runtime's trainer container is `node`"
    t = doc["spec"]["trainer"]
    c.update(
        image=t["image"], command=t["command"], args=t["args"], env=t["env"], resources=t["resourcesPerNode"]
    )
    return {"node": template}


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def jobs() -> list[dict]:
    return [one("TrainJob"), one("PyTorchJob")]


def trainer_pod() -> dict:
    (sts,) = [d for d in render(ROOT / "deploy" / "k8s" / "base") if d["kind"] == "StatefulSet"]
    return sts["spec"]["template"]


def injected_env(doc: dict) -> list[dict[str, str]]:
    """The environment each process of the job starts with: what the operator injects (kubeflow/trainer's torch
    plugin; training-operator v1.9.0 pkg/controller.v1/pytorch/envvar.go), then, for the TrainJob, what torchrun
    adds per local rank when the worker re-runs itself under it."""
    if doc["kind"] == "PyTorchJob":
        specs = doc["spec"]["pytorchReplicaSpecs"]
        total = sum(r["replicas"] for r in specs.values())
        master, port = f"{doc['metadata']['name']}-master-0", "23456"
        out = []
        for role, offset in (("Master", 0), ("Worker", 1)):
            for i in range(specs.get(role, {}).get("replicas", 0)):
                rank = str(i + offset)
                out.append(
                    {
                        "PYTHONUNBUFFERED": "1",
                        "MASTER_ADDR": master,
                        "MASTER_PORT": port,
                        "PET_MASTER_ADDR": master,
                        "PET_MASTER_PORT": port,
                        "WORLD_SIZE": str(total),
                        "RANK": rank,
                        "PET_NODE_RANK": rank,
                        "PET_NNODES": str(total),
                    }
                )
        return out
    t, name = doc["spec"]["trainer"], doc["metadata"]["name"]
    nodes, nproc = t["numNodes"], t["numProcPerNode"]
    out = []
    for node in range(nodes):
        pet = {
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": TRAINJOB_MASTER_PORT,
        }
        out.append(pet)  # the pod's own process: no RANK yet
        for local in range(nproc):
            out.append(
                {
                    **pet,
                    "RANK": str(node * nproc + local),
                    "WORLD_SIZE": str(nodes * nproc),
                    "LOCAL_RANK": str(local),
                    "MASTER_ADDR": pet["PET_MASTER_ADDR"],
                    "MASTER_PORT": TRAINJOB_MASTER_PORT,
                }
            )
    return out


class RecordingEnviron(dict):
    """os.environ's stand-in: remembers every variable looked up."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


# --- schemas


def test_every_document_validates_against_its_schema():
    docs = all_docs()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "NetworkPolicy", "PyTorchJob", "TrainJob"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "strop"
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            check_crd(doc)
        else:
            for version in (OLDEST_KUBERNETES, KUBERNETES_VERSION):
                kubernetes_validate.validate(doc, version, strict=True)


def test_the_vendored_schemas_are_the_crds_structural_v3_schemas():
    for name in CRDS.values():
        schema = json.loads((SCHEMAS / name).read_text())
        assert schema["type"] == "object" and {"apiVersion", "kind", "metadata", "spec"} <= set(
            schema["properties"]
        )
        jsonschema.Draft7Validator.check_schema(schema)
    readme = (SCHEMAS / "README.md").read_text()
    for name in CRDS.values():
        assert name in readme, f"crd_schemas/README.md: say where {name} came from"


POD_PATCH = (
    "spec/runtimePatches/0/trainingRuntimeSpec/template/spec/replicatedJobs/0/template/spec/template/spec"
)


@pytest.mark.parametrize(
    "kind,path,key",
    [
        ("TrainJob", "spec/trainer", "numNode"),
        ("TrainJob", POD_PATCH, "securityContex"),
        ("TrainJob", POD_PATCH + "/containers/0/volumeMounts/0", "mountpath"),
        ("PyTorchJob", "spec/pytorchReplicaSpecs/Master/template/spec/containers/0", "volumeMount"),
        ("PyTorchJob", "spec/runPolicy", "cleanPodPolcy"),
        ("PyTorchJob", "metadata", "label"),
    ],
)
def test_a_misspelt_field_is_refused(kind, path, key):
    doc = copy.deepcopy(one(kind))
    node = doc
    for p in path.split("/"):
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[key] = {}
    with pytest.raises(AssertionError, match="fields the CRD does not declare"):
        check_crd(doc)


def test_a_duplicate_list_map_key_and_a_wrong_type_are_refused():
    doc = copy.deepcopy(one("TrainJob"))
    env = doc["spec"]["trainer"]["env"]
    env.append(dict(env[0]))
    with pytest.raises(AssertionError, match="fields the CRD does not declare"):
        check_crd(doc)
    doc = copy.deepcopy(one("PyTorchJob"))
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        check_crd(doc)


def test_the_jobs_name_their_operators_runtime_and_roles():
    tj = one("TrainJob")
    assert tj["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert tj["spec"]["trainer"]["numNodes"] >= 2
    pj = one("PyTorchJob")
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1  # rank 0 is the Master
    assert (
        "nprocPerNode" not in pj["spec"] and "elasticPolicy" not in pj["spec"]
    )  # RANK is the pod's, LOCAL_RANK 0
    for pod in pods(pj).values():
        assert container(pod)["name"] == "pytorch"  # the operator finds its container (and port) by this name
        (port,) = container(pod)["ports"]
        assert port["name"] == "pytorchjob-port"


# --- the pods against the worker


def test_the_pods_run_the_dist_worker_with_its_real_flags(monkeypatch):
    options = record_parsed_options(monkeypatch)
    containerfile = (ROOT / "deploy" / "Containerfile.trainer").read_text()
    assert "/opt/strop/bin" in containerfile, "the trainer image's venv is /opt/strop"
    for doc in jobs():
        for role, pod in pods(doc).items():
            c = container(pod)
            assert c["command"] == WORKER_MODULE, f"{doc['kind']} {role}"
            assert c["image"].rpartition(":")[0].endswith("strop/trainer"), "the trainer image"
            environ = RecordingEnviron({e["name"]: e["value"] for e in c["env"]})
            monkeypatch.setattr(os, "environ", environ)
            options.clear()
            a = dist_worker.parse_args(c["args"])  # an unknown flag or a bad value exits (SystemExit) here
            spelled = {arg.split("=", 1)[0] for arg in c["args"]}
            assert spelled <= options, (
                f"{doc['kind']}: {spelled - options} are not the worker's flags as spelled"
            )
            # every variable the manifest sets is one the worker reads, and it takes effect
            assert set(environ) <= environ.read, (
                f"{doc['kind']}: {set(environ) - environ.read} are read nowhere"
            )
            assert {k: getattr(a, k) for k in EXPECTED_ROOTS} == EXPECTED_ROOTS
            # the spec is the ConfigMap's job.json, mounted where --spec reads it
            (cm_volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
            assert cm_volume["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == cm_volume["name"]]
            assert a.spec == f"{mount['mountPath']}/job.json" and mount["readOnly"]
            # no launch variable of the operator's is overridden by the manifest
            assert not {e["name"] for e in c["env"]} & (set(dist_worker.LAUNCH_ENV) | {"PYTHONUNBUFFERED"})
            assert not [e["name"] for e in c["env"] if e["name"].startswith("PET_")]


def test_the_job_spec_is_a_distributed_job_with_no_unknown_field():
    spec = json.loads(one("ConfigMap")["data"]["job.json"])
    job = serde.from_dict(DistributedJob, spec)  # from_dict ignores unknown keys: compare with its round trip

    def missing(written: dict, known: dict, path: str = "") -> list[str]:
        out = []
        for k, v in written.items():
            if k not in known:
                out.append(f"{path}.{k}")
            elif isinstance(v, dict):
                out += missing(v, known[k], f"{path}.{k}")
        return out

    assert missing(spec, serde.to_dict(job)) == []
    assert job.job_id and job.model.model_path and job.dataset_path and job.tenant
    assert serde.to_dict(job)["dataset_format"] == spec["dataset_format"]  # an enum name the worker knows


@pytest.mark.parametrize("kind", ["TrainJob", "PyTorchJob"])
def test_each_rank_sees_the_environment_the_worker_expects(kind, monkeypatch, tmp_path):
    """Run the worker's main() with each process's injected environment (run() stubbed): every rank parses the
    ConfigMap's spec, ranks are 0..W-1 once each with one WORLD_SIZE, and a TrainJob pod's own process (PET_* and
    no RANK) re-runs itself under torchrun."""
    doc = one(kind)
    (pod,) = {
        id(p): p for p in pods(doc).values()
    }.values()  # a PyTorchJob's Master and Worker share one template
    c = container(pod)
    spec_file = tmp_path / "job.json"
    spec_file.write_text(one("ConfigMap")["data"]["job.json"])
    args = [a if not a.startswith("--spec=") else f"--spec={spec_file}" for a in c["args"]]
    seen: list[tuple[dist_worker.Rank, dict]] = []

    class Relaunch(Exception):
        pass

    def fake_relaunch():
        raise Relaunch

    def fake_run(spec, **kw):
        seen.append((dist_worker.rank_from_env(), {"job_id": spec.job_id, **kw}))
        return JobState.SUCCEEDED

    monkeypatch.setattr(dist_worker, "_relaunch_with_torchrun", fake_relaunch)
    monkeypatch.setattr(dist_worker, "run", fake_run)
    relaunched = 0
    for injected in injected_env(doc):
        environ = {**{e["name"]: e["value"] for e in c["env"]}, **injected}
        monkeypatch.setattr(os, "environ", environ)
        try:
            dist_worker.main(args)
        except Relaunch:
            relaunched += 1
            assert "RANK" not in environ
        except SystemExit as exc:
            assert exc.code == 0
    ranks = [r for r, _ in seen]
    world = {r.world_size for r in ranks}
    assert len(world) == 1 and sorted(r.rank for r in ranks) == list(range(next(iter(world))))
    # the world the spec declares (num_nodes x num_devices), which each rank checks before it trains
    assert serde.from_dict(DistributedJob, json.loads(spec_file.read_text())).config.ranks() == world.pop()
    assert {kw["job_id"] for _, kw in seen} == {json.loads(spec_file.read_text())["job_id"]}
    assert {str(kw["artifact_root"]) for _, kw in seen} == {"/data/artifacts"}
    if kind == "TrainJob":
        assert relaunched == doc["spec"]["trainer"]["numNodes"], "each pod re-runs itself under torchrun"
    else:
        assert relaunched == 0, "a PyTorchJob pod has RANK: it runs as that rank"


def test_gpus_placement_security_and_storage_match_the_trainer():
    trainer = trainer_pod()["spec"]
    (tc,) = trainer["containers"]
    pvc = [d for d in render(ROOT / "deploy" / "k8s" / "base") if d["kind"] == "PersistentVolumeClaim"]
    (claim,) = pvc
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    for doc in jobs():
        for role, pod in pods(doc).items():
            what, spec, c = f"{doc['kind']} {role}", pod["spec"], container(pod)
            assert spec["securityContext"] == trainer["securityContext"], what
            assert c["securityContext"] == tc["securityContext"], what
            assert (
                spec["nodeSelector"] == trainer["nodeSelector"]
                and spec["tolerations"] == trainer["tolerations"]
            )
            assert spec["serviceAccountName"] == trainer["serviceAccountName"]
            res = c["resources"]
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
            gpus = res["limits"]["nvidia.com/gpu"]
            nproc = doc["spec"]["trainer"]["numProcPerNode"] if doc["kind"] == "TrainJob" else 1
            assert gpus == nproc, f"{what}: one rank per GPU"
            for k in ("cpu", "memory", "ephemeral-storage"):
                assert k in res["requests"] and k in res["limits"], what
            # the shared volume where the image expects /data, its models/ read-only
            claims = {
                v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in spec["volumes"]
                if "persistentVolumeClaim" in v
            }
            assert set(claims.values()) == {claim["metadata"]["name"]}, what
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert mounts["/data"]["name"] in claims and not mounts["/data"].get("readOnly")
            assert mounts["/data/models"]["subPath"] == "models" and mounts["/data/models"]["readOnly"]
            # read-only root: the worker's scratch (STROP_WORK_DIR) and caches under /tmp, an emptyDir
            empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
            assert mounts["/tmp"]["name"] in empty and mounts["/dev/shm"]["name"] in empty
            # the NetworkPolicy lets the ranks reach each other
            policy = one("NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
            assert policy.items() <= pod["metadata"]["labels"].items(), what


def test_readme_says_how_to_apply_them():
    readme = (ROOT / "deploy" / "README.md").read_text()
    for job in JOBS.values():
        assert f"kubectl apply -k deploy/k8s/training-operators/{job}" in readme
    assert "torch-distributed" in readme and "PyTorchJob" in readme


def test_each_kustomization_renders_the_job_spec_and_its_job_on_the_production_trainer_image():
    (production,) = {
        c["image"]
        for d in render(ROOT / "deploy" / "k8s" / "overlays" / "production")
        if d["kind"] == "StatefulSet"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    for kind, job in JOBS.items():
        docs = render(DIR / job)
        assert sorted(d["kind"] for d in docs) == sorted(["ConfigMap", "NetworkPolicy", kind])
        (doc,) = [d for d in docs if d["kind"] == kind]
        if kind == "TrainJob":
            images = {doc["spec"]["trainer"]["image"]}
        else:
            images = {
                c["image"]
                for r in doc["spec"]["pytorchReplicaSpecs"].values()
                for c in r["template"]["spec"]["containers"]
            }
        # the registry is set in kustomize `images`, as in the production overlay, and the two agree
        assert images == {production}, f"{kind}: {images} vs the production trainer's {production}"
        raw = load(f"{job}/{job}.yaml")
        assert doc == {**raw[0], "spec": doc["spec"]} and doc["metadata"] == raw[0]["metadata"]
