"""Admission by device memory: the estimate bounds what a real forward saves for backward, and a job that
cannot fit is refused with its figures."""

from __future__ import annotations

import pytest
import torch

from strop.common.errors import ResourceExhausted
from strop.common.trainer_types import MemoryMode, TrainConfig, TrainMethod
from strop.trainer_svc.core import admission


def _saved_bytes_of_a_real_step(model, tokens: torch.Tensor) -> int:
    """Bytes of every distinct non-parameter tensor autograd saves in a forward, plus the logits' fp32 loss
    path (what the estimate calls layer activations and logits), measured with saved_tensors_hooks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the flash kernel, which saves no T x T matrix, as the estimate assumes (on every CPU: no backend choice)
    with (
        sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
    return sum(seen.values())


def assert_estimate_bounds_a_real_step(
    config, model, rows: int, length: int, expert_lora: bool = False, nf4_experts: bool = False
):
    """The estimate of keeping every layer (HF + PEFT, no checkpointing) against what a real forward of ``model``
    on ``rows`` × ``length`` random tokens saves for backward: at least that, and at most twice it. Returns the
    job config, the trainable parameter count and the estimate."""
    tokens = torch.randint(0, 1000, (rows, length))
    measured = _saved_bytes_of_a_real_step(model, tokens)
    cfg = TrainConfig(method=TrainMethod.SFT, batch_size=rows, max_length=length, optimizer="adamw_torch")
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    est = admission.estimate(
        config,
        cfg,
        longest_row=length,
        n_trainable=n_trainable,
        checkpointed=False,
        offloaded=False,
        kernels=False,
        expert_lora=expert_lora,
        nf4_experts=nf4_experts,
    )
    predicted = est.layers + est.logits
    assert measured <= predicted <= 2.0 * measured, (measured, predicted, str(est))
    return cfg, n_trainable, est


def test_the_estimate_bounds_what_a_real_forward_saves_and_is_not_loose():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    rows, length = 2, 384
    cfg, n_trainable, est = assert_estimate_bounds_a_real_step(config, model, rows, length)
    assert est.adapter_state == 12 * n_trainable
    # checkpointing keeps one input per layer and one layer's activations: far below keeping every layer
    ckpt = admission.estimate(
        config,
        cfg,
        longest_row=length,
        n_trainable=n_trainable,
        checkpointed=True,
        offloaded=False,
        kernels=False,
    )
    off = admission.estimate(
        config,
        cfg,
        longest_row=length,
        n_trainable=n_trainable,
        checkpointed=True,
        offloaded=True,
        kernels=False,
    )
    assert off.layers < ckpt.layers < est.layers


def test_a_job_that_cannot_fit_is_refused_with_its_figures_and_one_that_fits_is_admitted():
    from transformers import LlamaConfig

    eight_b = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    cfg = TrainConfig(method=TrainMethod.SFT, batch_size=16, max_length=2048, optimizer="adamw_torch")
    kw = dict(longest_row=2048, n_trainable=42_000_000, kernels=True)
    standard = admission.estimate(eight_b, cfg, checkpointed=True, offloaded=True, **kw)
    no_ckpt = admission.estimate(eight_b, cfg, checkpointed=False, offloaded=False, **kw)
    # 16 x 2048 tokens without checkpointing: 32 layers of activations, beyond an 80 GiB device
    assert no_ckpt.total > 80 * 2**30 > 20 * 2**30 > standard.total
    admission.admit(standard, 80 * 2**30)
    with pytest.raises(ResourceExhausted, match=r"needs ≈\d+\.\d+ GiB .* LONG_CONTEXT"):
        admission.admit(no_ckpt, 80 * 2**30)
    # a short dataset is estimated by its longest row, not by max_length
    short = admission.estimate(eight_b, cfg, checkpointed=False, offloaded=False, **{**kw, "longest_row": 64})
    assert short.tokens == 16 * 64 and short.total < no_ckpt.total / 20


def test_a_job_that_fits_only_with_adams_moments_in_host_memory_is_admitted_that_way():
    """The moments are 8 of the 12 bytes a trainable element holds: a job between the two estimates is admitted
    with them on the host (admit says so), one above both is refused naming both."""
    from transformers import LlamaConfig

    from strop.kernels.models.host_adamw import host_adamw_device_bytes

    one_b = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    cfg = TrainConfig(method=TrainMethod.SFT, batch_size=1, max_length=2048, optimizer="adamw_torch")
    kw = dict(longest_row=2048, n_trainable=600_000_000, kernels=True, checkpointed=True, offloaded=True)
    device = admission.estimate(one_b, cfg, **kw)
    host = admission.estimate(one_b, cfg, host_adam_moments=True, **kw)
    assert device.adapter_state == 12 * 600_000_000
    assert host.adapter_state == 4 * 600_000_000 + host_adamw_device_bytes()
    assert (host.layers, host.logits) == (device.layers, device.logits)
    between = (host.total + device.total) // 2
    assert admission.admit(device, between, host) is True
    assert (
        admission.admit(device, device.total, host) is False
    )  # fits as it is: the moments stay on the device
    with pytest.raises(ResourceExhausted, match="with AdamW's moments in host memory: ≈"):
        admission.admit(device, host.total - 1, host)


def test_a_trainer_told_to_hold_adams_moments_on_host_trains_bit_for_bit_as_with_torch_adamw(tmp_path):
    """transformers' Trainer (clipping, schedule, two parameter groups, checkpoints) with HostAdamW in place of
    torch's AdamW: the same parameters after its steps, bit for bit; so does a run resumed from HostAdamW's
    checkpoint halfway (its moments loaded back into host memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from strop.kernels.models.host_adamw import HostAdamW

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, 64, (12,), generator=g)), "labels": ids} for _ in range(8)]
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )

    def train(host: bool, resume: str | None = None):
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{host}{'-resumed' if resume else ''}"),
            per_device_train_batch_size=2,
            max_steps=4,
            learning_rate=1e-2,
            weight_decay=0.1,
            max_grad_norm=0.5,
            lr_scheduler_type="cosine",
            save_strategy="steps",
            save_steps=2,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        if host:
            admission.hold_adam_moments_on_host(trainer)
        trainer.train(resume_from_checkpoint=resume)
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return model, opt

    ref, ref_opt = train(False)
    got, opt = train(True)
    assert type(ref_opt) is torch.optim.AdamW and type(opt) is HostAdamW
    assert len(opt.param_groups) == 2 and opt.param_groups[0]["weight_decay"] == 0.1
    for (name, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), name
    resumed, opt = train(True, resume=str(tmp_path / "True" / "checkpoint-2"))
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    for (name, a), b in zip(ref.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), f"resumed: {name}"


def test_the_trainer_admits_a_job_with_adams_moments_on_host_only_when_they_would_not_fit(
    monkeypatch, tmp_path
):
    """training._admit_by_device_memory with CUDA's free memory faked, for a session of a 1B shape with 600 M
    trainable elements: room for the whole estimate leaves torch's AdamW; room between the two estimates makes the
    trainer build HostAdamW; less is refused; 8-bit Adam (not reproduced by HostAdamW), a job on several ranks and
    a host without room for the moments are never switched."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from strop.kernels.models.host_adamw import HostAdamW
    from strop.trainer_svc.core import training

    one_b = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    n = 600_000_000
    session = SimpleNamespace(  # what admission reads of the session's model: its config and trainable sizes
        config=one_b,
        parameters=lambda: [SimpleNamespace(numel=lambda: n, requires_grad=True)],
        named_modules=lambda: [],
    )
    loaded = SimpleNamespace(
        model=session,
        device="cuda:0",
        lora=None,
        facts=SimpleNamespace(kernels_enabled=True),
        pending_device_bytes=0,
    )
    for fake in ("memory_reserved", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, fake, lambda _d: 0)
    from strop.kernels.models import memory

    monkeypatch.setattr(
        memory, "host_available_bytes", lambda: 1 << 40
    )  # a host with room (until said otherwise)
    tiny = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
        )
    )
    rows = [{"input_ids": torch.arange(12), "labels": torch.arange(12)}]

    def admitted(free: int, **cfg_kw):
        """The optimizer class the trainer was told to build (None: its own), with ``free`` device bytes."""
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d: (free, 2 * free))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        trainer = Trainer(model=tiny, args=args, train_dataset=rows)
        cfg = TrainConfig(
            **{
                "method": TrainMethod.SFT,
                "batch_size": 1,
                "max_length": 2048,
                "optimizer": "adamw_torch",
                "memory_mode": MemoryMode.STANDARD,
                **cfg_kw,
            }
        )
        training._admit_by_device_memory(loaded, cfg, trainer, None)
        return (trainer.optimizer_cls_and_kwargs or (None,))[0]

    cfg = TrainConfig(method=TrainMethod.SFT, batch_size=1, max_length=2048, optimizer="adamw_torch")
    # what the trainer estimates: rows without token columns count as max_length; no memory mode installed
    kw = dict(longest_row=2048, n_trainable=n, kernels=True, checkpointed=False, offloaded=False)
    device = admission.estimate(one_b, cfg, **kw)
    host = admission.estimate(one_b, cfg, host_adam_moments=True, **kw)
    assert host.total < device.total
    between = (host.total + device.total) // 2
    assert admitted(device.total) is None
    assert admitted(between) is HostAdamW
    with pytest.raises(ResourceExhausted, match="moments in host memory"):
        admitted(host.total - 1)
    assert admitted(host.total) is HostAdamW
    # 8-bit Adam's 6 bytes an element do not fit there either, and it keeps its own optimizer
    with pytest.raises(ResourceExhausted):
        admitted(host.total, optimizer="adamw_8bit")
    with pytest.raises(ResourceExhausted):
        admitted(between, num_devices=2)
    # nor a host without room for the moments' pinned copies (16 bytes a trainable parameter counted) beside the
    # standard mode's offloaded activations (half the host)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 32 * n - 2)
    with pytest.raises(ResourceExhausted):
        admitted(between)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 32 * n)
    assert admitted(between) is HostAdamW


def test_the_moments_go_to_the_host_only_beside_what_the_memory_mode_may_offload_there():
    """16 bytes a trainable parameter (the moments' pinned copies counted twice) must fit in the host memory the
    job's mode leaves beside its offloaded activations: all of it without offload, half in the standard mode (layer
    inputs offload only into half the host), a fifth in LONG_CONTEXT (its host budget is 0.8 of it)."""
    from strop.common.memory_modes import MEMORY_MODES, MemoryMode

    n = 1_000_000
    room = admission.host_has_room_for_moments
    assert room(n, None) and room(n, 16 * n) and not room(n, 16 * n - 1)
    assert room(n, 32 * n, MEMORY_MODES[MemoryMode.STANDARD]) and not room(
        n, 32 * n - 2, MEMORY_MODES[MemoryMode.STANDARD]
    )
    assert room(n, 80 * n + 5, MEMORY_MODES[MemoryMode.LONG_CONTEXT])
    assert not room(n, 79 * n, MEMORY_MODES[MemoryMode.LONG_CONTEXT])
    assert room(n, 16 * n, MEMORY_MODES[MemoryMode.MAX_SPEED])  # offloads nothing


def test_retentions_kl_batch_counts_as_rows_of_the_step_and_its_cached_base_states_as_held():
    """The KL term's batch runs its forward and backward in the same step as the training rows (``retention``), so
    its positions count as the rows' do; the base hidden states it keeps for its scored positions are held too."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=8, vocab_size=1000
    )
    cfg = TrainConfig(method=TrainMethod.SFT, batch_size=4, max_length=100)
    shape = dict(longest_row=100, n_trainable=1000, checkpointed=True, offloaded=False, kernels=False)
    rows_only = admission.estimate(config, cfg, **shape)
    more_rows = admission.estimate(
        config, TrainConfig(method=TrainMethod.SFT, batch_size=36, max_length=100), **shape
    )
    with_kl = admission.estimate(config, cfg, kl_tokens=3200, **shape)
    # 32 KL rows of 100 positions cost what 32 more training rows of 100 do (the logits' share included)
    assert with_kl.tokens == more_rows.tokens == 3600 and with_kl.total == more_rows.total > rows_only.total
    cached = admission.estimate(config, cfg, kl_tokens=3200, kl_cached_tokens=5000, **shape)
    assert cached.total - with_kl.total == 5000 * 256 * 4, "fp32 states of the kept positions, at most"
