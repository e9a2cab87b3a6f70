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
    "gateways": "strop.gateways",
    "graders": "strop.graders",
}
TORCH_LIBRARIES = ("torch", "triton", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
SERVICES = ("strop.trainer_svc", "strop.export_svc")
ROOTS = ("strop.cli", "strop.demo", "strop.gateways")


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


def test_the_gateways_are_clients_of_the_services():
    # an HTTP gateway speaks to the trainer over gRPC (the SDK), never through its internals, kernels or torch
    assert not _hits(["strop.gateways"], [*SERVICES, "strop.kernels", "strop.fixtures", *TORCH_LIBRARIES])


def test_the_graders_are_a_library_under_the_services_and_gateways():
    # the trainer's GRPO jobs and the OpenAI gateway both use them: they import neither, nor torch nor gRPC
    others = sorted(m for m in GRAPH if not m.startswith(("strop.graders", "strop.common")))
    assert not _hits(["strop.graders"], [*others, *TORCH_LIBRARIES, "grpc", "strop.v1"])


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


def test_the_export_service_takes_from_the_kernels_only_what_needs_no_triton():
    # the exporter's CPU nodes have no Triton: it shares the NF4 format's facts (the digest) and nothing else
    import subprocess
    import sys

    allowed = {"strop.kernels", "strop.kernels.ops", "strop.kernels.ops.nf4_format"}
    assert not _hits(
        ["strop.export_svc"], sorted({m for m in GRAPH if m.startswith("strop.kernels")} - allowed)
    )
    code = (
        "import pkgutil, importlib, sys, strop.export_svc as e\n"
        "for m in pkgutil.walk_packages(e.__path__, 'strop.export_svc.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


KERNEL_ROOMS = [
    "ops",
    "lora",
    "losses",
    "models",
    "trainers",
]  # each imports only rooms before it in this order
KERNEL_ROOM_MAY_IMPORT = {
    "ops": set(),
    "lora": {"ops"},
    "losses": {"ops", "lora"},
    "models": {"ops", "lora"},  # model surgery and the chunked losses are siblings, not layers
    "trainers": {"ops", "lora", "losses", "models"},
}


@pytest.mark.parametrize("room", KERNEL_ROOMS)
def test_kernel_rooms_import_one_way(room):
    others = [
        f"strop.kernels.{r}" for r in KERNEL_ROOMS if r != room and r not in KERNEL_ROOM_MAY_IMPORT[room]
    ]
    assert not _hits([f"strop.kernels.{room}"], others)


# the log-prob engine, and what the preference losses share
LOSS_ENGINE = ("strop.kernels.losses.logps", "strop.kernels.losses.preference")


def test_each_loss_takes_the_one_engine_and_imports_no_other_loss():
    # Liger's chunked_loss shape: one file per loss over one log-prob engine; a loss that imported another's
    # module would make that module a second owner of what they share
    losses = sorted(m for m in GRAPH if m.startswith("strop.kernels.losses.") and m not in LOSS_ENGINE)
    assert {m.rsplit(".", 1)[1] for m in losses} >= {"dpo", "orpo", "cpo", "kto", "rl", "grpo", "kl"}
    bad = [
        f"{m} imports {name}"
        for m in [*losses, *LOSS_ENGINE]
        for name in sorted(GRAPH[m])
        if any(name == o or name.startswith(o + ".") for o in losses if o != m)
    ]
    assert not bad


# a tokenizer as GGUF metadata, each module importing only those before it: llama.cpp's facts (the hash table, the
# family regexes, the behaviours), the name predicted from a tokenizer, the record, the proof with llama.cpp, and the
# one decision LoadModel and the export share
GGUF_TOKENIZER_ORDER = [
    "strop.common.pretokenizer_table",
    "strop.common.pretokenizers",
    "strop.common.gguf_metadata",
    "strop.common.gguf_pretok",
    "strop.common.gguf_vocab",
]


@pytest.mark.parametrize("module", GGUF_TOKENIZER_ORDER)
def test_the_gguf_tokenizer_modules_import_one_way(module):
    later = GGUF_TOKENIZER_ORDER[GGUF_TOKENIZER_ORDER.index(module) + 1 :]
    assert module in GRAPH
    assert not _hits([module], later)


def _cycles() -> list[list[str]]:
    """Strongly connected groups of strop modules (Tarjan). An import of ``a.b.c`` counts as an edge to the module
    ``a.b.c`` (or its nearest enclosing module), not to the packages above it, which Python initialises first but
    which a module never depends on for that."""
    import sys

    mods = set(GRAPH)

    def target(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = {
        m: {t for n in GRAPH[m] if (t := target(n)) and t != m and not m.startswith(t + ".")} for m in mods
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    global GRAPH
    saved = GRAPH
    GRAPH = {"strop.a": {"strop.b"}, "strop.b": {"strop.a.x", "strop.a"}}
    try:
        assert _cycles() == [["strop.a", "strop.b"]]
    finally:
        GRAPH = saved


def test_no_package_has_an_import_cycle():
    # every import counts, also those under TYPE_CHECKING and inside functions: a cycle there is still a coupling
    assert _cycles() == []
