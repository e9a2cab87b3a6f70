"""Memory modes: one table (``MEMORY_MODES``) says what each installs, and ``apply_memory_mode`` installs exactly that."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strop.common.trainer_types import MEMORY_MODES, MemoryMode
from strop.kernels.models import StepShape, apply_memory_mode
from tests.kernels.models.test_offload import _tiny_llama

STEP = StepShape(rows=2, seq_len=17)


def _install(mode, **kw):
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw.setdefault("step", STEP)
    return model, apply_memory_mode(model, mode, offload_cpu_tensors=True, min_offload_bytes=0, **kw)


def test_every_mode_has_a_row_and_legacy_strings_still_parse():
    assert set(MEMORY_MODES) == {m for m in MemoryMode if m is not MemoryMode.UNSPECIFIED}
    assert MemoryMode("long_context") is MemoryMode.LONG_CONTEXT and MemoryMode("") is MemoryMode.UNSPECIFIED


def test_standard_offloads_the_layer_inputs_without_tiling_and_removes_cleanly():
    model, installed = _install(MemoryMode.UNSPECIFIED)  # the default mode
    assert installed.mode is MemoryMode.STANDARD
    assert installed.memory.offloader is not None and installed.memory.tiled_mlp is None
    assert "_strop_offload" in model.__dict__
    installed.remove()
    assert "_strop_offload" not in model.__dict__ and "_strop_tiled_mlp" not in model.__dict__


def test_standard_keeps_inputs_on_the_device_when_the_host_has_no_room_but_long_context_offloads(monkeypatch):
    import strop.kernels.models.memory as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 0)
    _, standard = _install(MemoryMode.STANDARD)
    assert standard.memory is None and "no host room" in str(standard)
    _, unchecked = _install(MemoryMode.STANDARD, step=StepShape(2, 17, checkpointed=False))
    assert unchecked.memory is None  # without checkpointing there are no layer inputs to offload
    monkeypatch.undo()  # long context offloads whatever its share of the host holds, without a whole-step check
    model, long_context = _install(MemoryMode.LONG_CONTEXT)
    assert long_context.memory.offloader is not None and long_context.memory.tiled_mlp.tiled
    loss = model(input_ids=torch.randint(0, 300, (2, 17)), labels=torch.randint(0, 300, (2, 17))).loss
    loss.backward()  # the installed machinery trains
    assert long_context.memory.offloader.stats.offloaded > 0


def test_a_table_row_passed_as_its_features_installs_what_its_mode_does_and_a_variant_is_no_mode():
    # the benchmark passes the row (a dataclasses.replace of it for its -sN/-aB/-tB variants), the trainer the
    # mode: one installer, so the benchmark's strop-standard is the trainer's default
    row = MEMORY_MODES[MemoryMode.STANDARD]
    _, by_mode = _install(MemoryMode.STANDARD)
    model, by_row = _install(dataclasses.replace(row))
    assert by_row.mode is MemoryMode.STANDARD and by_row.features == by_mode.features == row
    assert str(by_row) == str(by_mode) and by_row.notes == by_mode.notes
    assert model.__dict__["_strop_offload"].save_layers == 0
    model, variant = _install(dataclasses.replace(row, save_layers=1))
    assert variant.mode is None and variant.features.save_layers == 1
    assert model.__dict__["_strop_offload"].save_layers == 1
    loss = model(input_ids=torch.randint(0, 300, (2, 17)), labels=torch.randint(0, 300, (2, 17))).loss
    loss.backward()
    assert variant.memory.offloader.stats.saved_offloaded > 0  # a layer skipped its recompute


def test_max_speed_needs_a_budget_or_a_cuda_device_to_take_its_share_of():
    with pytest.raises(ValueError, match="needs a CUDA device or a positive budget_bytes"):
        _install(MemoryMode.MAX_SPEED)


def test_long_context_bounds_host_memory_by_a_share_of_what_the_host_has(monkeypatch):
    import strop.kernels.models.memory as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10 << 30)
    _, installed = _install(MemoryMode.LONG_CONTEXT)
    fraction = MEMORY_MODES[MemoryMode.LONG_CONTEXT].host_budget_fraction
    assert installed.memory.offloader.host_budget_bytes == int(
        fraction * (10 << 30)
    ) and "host budget 8.0 GiB" in str(installed)
    installed.remove()
    # the standard mode checks the whole step's room up front (host_room) and sets no bound
    _, standard = _install(MemoryMode.STANDARD)
    assert standard.memory.offloader.host_budget_bytes is None
    standard.remove()


def test_host_available_bytes_is_capped_by_the_container_working_set(monkeypatch, tmp_path):
    import strop.kernels.models.memory as memory

    limit, usage, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    limit.write_text(f"{3 << 30}\n")
    usage.write_text(f"{2 << 30}\n")
    stat.write_text(f"anon {1 << 30}\ninactive_file {1 << 30}\nactive_file 0\n")
    monkeypatch.setattr(memory, "_CGROUP_FILES", ((str(limit), str(usage), str(stat)),))
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 5 << 30)
    # the pod's limit less its working set (usage less reclaimable page cache), under the node's MemAvailable
    assert memory.host_available_bytes() == 2 << 30
    stat.unlink()  # no breakdown: all of the usage counts
    assert memory.host_available_bytes() == 1 << 30
    limit.write_text("max\n")  # cgroup v2: no limit
    assert memory.host_available_bytes() == 5 << 30
    monkeypatch.setattr(memory, "_CGROUP_FILES", ())
    monkeypatch.setattr(memory, "_meminfo_available", lambda: None)
    assert memory.host_available_bytes() is None
    _, installed = _install(
        MemoryMode.LONG_CONTEXT
    )  # unknown host memory: no bound rather than none offloaded
    assert installed.memory.offloader.host_budget_bytes is None
    installed.remove()


def test_the_host_room_rule_saves_attention_outputs_only_where_the_host_holds_them_beside_the_inputs(
    monkeypatch,
):
    # 8B shape, 8 × 2048 rows: each layer's input is 128 MiB and its attention output 128 MiB plus a 2 MiB
    # log-sum-exp (each rounded up to a power of two, as the pinned allocator does), its q 128 MiB and its k and v
    # 32 MiB each (8 KV heads): 32 layers need 4 GiB of inputs, 8.06 GiB with the outputs and 14.06 GiB with q, k,
    # v, against half the host's available memory
    from types import SimpleNamespace

    import strop.kernels.models.memory as memory

    config = SimpleNamespace(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    )
    embeddings = SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16))
    model = SimpleNamespace(config=config, get_input_embeddings=lambda: embeddings)
    gib = 2**30
    for available, expected in (
        (7 * gib, (False, False, False)),
        (10 * gib, (True, False, False)),
        (17 * gib, (True, True, False)),
        (28 * gib, (True, True, False)),
        (29 * gib, (True, True, True)),
    ):
        monkeypatch.setattr(memory, "host_available_bytes", lambda a=available: a)
        got = memory.host_room(model, StepShape(rows=8, seq_len=2048))
        assert got == expected, (available / gib, expected)


def test_standard_keeps_q_k_v_only_where_the_host_holds_them_beside_the_attention_outputs(monkeypatch):
    import strop.kernels.models.memory as memory

    assert MEMORY_MODES[MemoryMode.STANDARD].save_qkv  # the default mode keeps them where the host has room
    rows = []
    for fits in ((True, True, True), (True, True, False), (True, False, False)):
        monkeypatch.setattr(memory, "host_room", lambda model, step, f=fits: f)
        _, installed = _install(MemoryMode.STANDARD)
        off = installed.memory.offloader
        rows.append((off.save_attention, off.save_qkv, installed.notes))
        installed.remove()
    assert rows[0] == (True, True, [])
    assert rows[1] == (
        True,
        False,
        ["q, k, v recomputed: no host room for them beside the attention outputs"],
    )
    assert rows[2] == (False, False, ["attention recomputed: no host room for the outputs beside the inputs"])
