"""An export service killed mid-export (SIGKILL: no drain, no cleanup) restarts with the export INTERRUPTED,
nothing of it published, its staging removed, and the same export runs again to the end."""

from __future__ import annotations

from strop.client.export import ExportClient
from strop.common.artifacts import ArtifactStore
from strop.common.export_types import ExportState, ExportTarget
from strop.demo.services import start_service


def test_an_export_killed_mid_write_is_interrupted_and_leaves_nothing(export_models, tmp_path):
    args = ["--model-root", str(export_models), "--artifact-root", str(tmp_path / "arts")]
    args += ["--state-dir", str(tmp_path / "state")]
    targets = [ExportTarget.merged(), ExportTarget.gguf("F16"), ExportTarget.gguf("Q8_0")]
    svc = start_service("export", args, tmp_path / "logs")
    try:
        with ExportClient(svc.target) as ec:
            export = ec.create_export(targets, adapter_path="trained-nf4-lora")
            seen = []
            for ev in ec.watch_export(export.export_id):
                if ev.progress is not None:
                    seen.append((ev.progress.target, ev.progress.phase))
                    # the merged target is written and a GGUF is being written: kill in the middle of it
                    if ev.progress.target.startswith("gguf") and ev.progress.phase == "write":
                        break
            assert ev.state is None or not ev.state.state.terminal, seen
    finally:
        svc.kill()
    store = ArtifactStore(tmp_path / "arts")
    assert store.list() == [], "nothing of the killed export was published"
    staged = list((store.root / ".tmp").iterdir()) if (store.root / ".tmp").exists() else []
    assert staged, "the kill left staging behind (so the restart has something to clean)"

    svc = start_service("export", args, tmp_path / "logs")
    try:
        with ExportClient(svc.target) as ec:
            e = ec.get_export(export.export_id)
            assert e.state is ExportState.INTERRUPTED, (e.state, e.error)
            assert e.error_code, "an error code tells a pipeline to retry"
            assert not list((store.root / ".tmp").iterdir()), "its staging was removed"
            states = [ev.state.state for ev in ec.watch_export(export.export_id) if ev.state is not None]
            assert states[-1] is ExportState.INTERRUPTED, "watchers see the export's end"
            again = ec.wait_export(ec.create_export(targets, adapter_path="trained-nf4-lora").export_id)
            assert again.state is ExportState.SUCCEEDED, again.error
            assert sorted(a.kind for a in store.list()) == ["gguf", "gguf", "merged_safetensors"]
    finally:
        assert svc.stop() == 0, svc.log_tail()
