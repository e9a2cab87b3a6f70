"""The dependency walls, machine-checked from the import graph (every import, also those inside functions).

- kernels import no service, no SDK, no CLI, no demo, and no gRPC;
- the services' ``core`` packages import no gRPC and no generated protobuf code;
- the two services never import each other;
- the SDK (``client``) and ``common`` import no torch (nor a library built on it), no service, no CLI, no demo.

Composition roots (``cli``, ``demo``, the services' ``server``/``service`` modules) sit above the packages they
wire and are free to import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # folder → import name (pyproject's package-dir)
    "kernels": "strop.kernels",
    "trainer_svc": "strop.trainer_svc",
    "export_svc": "strop.export_svc",
    "client": "strop.client",
    "cli": "strop.cli",
    "common": "strop.common",
    "fixtures": "strop.fixtures",
    "demo": "strop.demo",
}
TORCH_LIBRARIES = ("torch", "triton", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
SERVICES = ("strop.trainer_svc", "strop.export_svc")
ROOTS = ("strop.cli", "strop.demo")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            graph[_module_name(path)] = _imports(path)
    return graph


GRAPH = _graph()


def _hits(prefixes, forbidden) -> list[str]:
    bad = []
    for module, imports in GRAPH.items():
        if not any(module == p or module.startswith(p + ".") for p in prefixes):
            continue
        for name in sorted(imports):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{module} imports {name}")
    return bad


def test_the_graph_covers_every_package():
    assert {m.split(".")[1] for m in GRAPH} >= {"kernels", "trainer_svc", "export_svc", "client", "common"}
    assert len(GRAPH) > 60


def test_kernels_import_no_service_sdk_cli_or_grpc():
    assert not _hits(["strop.kernels"], [*SERVICES, "strop.client", *ROOTS, "grpc", "strop.v1"])


@pytest.mark.parametrize("core", ["strop.trainer_svc.core", "strop.export_svc.core"])
def test_service_cores_import_no_grpc_and_no_generated_code(core):
    assert not _hits([core], ["grpc", "grpc_health", "grpc_reflection", "strop.v1", *ROOTS])


def test_the_services_never_import_each_other():
    assert not _hits(["strop.trainer_svc"], ["strop.export_svc"])
    assert not _hits(["strop.export_svc"], ["strop.trainer_svc"])


@pytest.mark.parametrize("library", ["strop.client", "strop.common"])
def test_sdk_and_common_import_no_torch_no_service_and_no_cli(library):
    assert not _hits([library], [*TORCH_LIBRARIES, *SERVICES, *ROOTS, "strop.kernels", "strop.fixtures"])


def test_importing_the_sdk_pulls_no_torch():
    import subprocess
    import sys

    code = "import strop.client, strop.client.export, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code % (TORCH_LIBRARIES,)], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
