"""The step API on mixtures of experts over real gRPC: a run's ``train_mlp`` is LoRA on every expert's gate/up/down
(PEFT's ``target_parameters`` on the fused stacks, as a job's LoRA config), on tiny fp32 Qwen3-MoE and Mixtral
fixtures (gpt-oss for training alone; 4 experts, 2 per token, hidden 64, expert width 32, 2 layers).

References. Training: the same two ForwardBackward + OptimStep rounds done by hand on HF + PEFT (the run's saved
adapter loaded by ``PeftModel``, full logits, ``torch.optim.AdamW``). Isolation: another run's expert pairs never
enter a run's step. The sampler: its prompt log-probs are the run's (Forward's and HF + PEFT's), which its expert
pairs move. strop's grouped expert GEMM (the kernels on, the Triton interpreter on the CPU) computes with whichever
run is active. Exports of a run's saved adapter are verified in their consumers. Admission counts every pair.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from strop.client import AdamParams, Datum, RunLora, SamplingParams
from strop.common.artifacts import key_of
from strop.common.trainer_types import KernelMode, Quantization
from strop.trainer_svc.core import step_ops

ARCHS = ("qwen3_moe", "mixtral")
SEQ = list(range(40, 61))  # 21 tokens of the fixtures' 320
SEQ2 = [7, 9, 300, 12, 200, 33, 1, 2, 3, 99, 100]
LORA = dict(rank=4, alpha=8)
H, I_E, E, LAYERS = 64, 32, 4, 2


def ce_datum(tokens, weights=None) -> Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return Datum.of(tokens[:-1], target_tokens=tokens[1:], weights=w)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    """The module's trainer serves the MoE fixtures (this overrides the session's tiny-Llama root)."""
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model

    root = tmp_path_factory.mktemp("moe-step-models")
    shape = TinyShape(
        hidden_size=H, intermediate_size=I_E, num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16
    )
    for arch in (*ARCHS, "gpt_oss"):
        make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
    return root


@pytest.fixture(scope="module")
def sessions(trainer):
    """One fp32 session per arch, HF's path (no CUDA), shared by the module's tests (each deletes its runs)."""
    from strop.client import TrainerClient

    running, _, _ = trainer
    with TrainerClient(f"127.0.0.1:{running.port}") as c:
        yield {
            a: c.load_model(a, quantization=Quantization.NONE, dtype="float32").session_id
            for a in (*ARCHS, "gpt_oss")
        }


def _loaded(trainer, session_id):
    return trainer[1].sessions.open(session_id).loaded


def _state(trainer, session_id, run_id):
    return step_ops.adapter_state_dict(_loaded(trainer, session_id), run_id)


def _expert_keys(state) -> list[str]:
    return [k for k in state if ".experts." in k]


def _artifact_dir(trainer, run, artifact_id) -> Path:
    return trainer[1].runs.artifacts.path_of(key_of(run.info.tenant, artifact_id))


def _reference(model_root, arch, adapter_dir):
    """HF + PEFT: the fixture with the saved adapter, trainable (PEFT's own loading of the run's files)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_root / arch, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def _ref_logps(ref, datum):
    ids = torch.tensor([datum.model_input])
    t = torch.tensor(datum.inputs()["target_tokens"].int_values)
    return ref(input_ids=ids).logits[0].float().log_softmax(-1).gather(1, t[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss"])
def test_a_run_trains_lora_on_every_expert_like_hf_and_peft(client, trainer, sessions, model_root, arch):
    """Two ForwardBackward + OptimStep rounds of a run against the same by hand on HF + PEFT from the run's saved
    initial adapter: the log-probs, losses and the adapter after both steps, its expert pairs included."""
    from peft import get_peft_model_state_dict

    run = client.create_training_run(sessions[arch], RunLora(**LORA, seed=3))
    assert run.info.target_modules == [*step_ops.ATTN_MODULES, *step_ops.MLP_MODULES]
    init = _state(trainer, sessions[arch], run.run_id)
    # one pair per fused stack (gate_up, down) per layer, each a rank-r pair per expert: A [E·r, in], B [out, E·r]
    experts = _expert_keys(init)
    assert len(experts) == 2 * 2 * LAYERS, experts
    r = LORA["rank"]
    assert sum(init[k].numel() for k in experts) == LAYERS * E * r * ((H + 2 * I_E) + (I_E + H))
    saved = _artifact_dir(trainer, run, run.save_weights(f"{arch}-init").artifact_id)
    ref = _reference(model_root, arch, saved)
    assert set(get_peft_model_state_dict(ref)) == set(init), (
        "the saved adapter is the run's, experts included"
    )
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False)
    data = [ce_datum(SEQ, [0.5 * (i % 3) for i in range(len(SEQ) - 1)]), ce_datum(SEQ2)]
    for _ in range(2):
        out = run.forward_backward(data, "cross_entropy")
        run.optim_step(AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01))
        opt.zero_grad()
        ref_loss = 0.0
        for d, got in zip(data, out.loss_fn_outputs, strict=True):
            lp = _ref_logps(ref, d)
            loss = -(lp * torch.tensor(d.inputs()["weights"].float_values)).sum()
            loss.backward()
            ref_loss += float(loss.detach())
            # fp32 forwards of a 2-layer model, chunked log-probs of a padded batch vs full logits of one row:
            # ~1e-6 apart (as the dense test); 1e-5 leaves an order of magnitude
            torch.testing.assert_close(torch.tensor(got.logprobs), lp.detach(), rtol=1e-5, atol=1e-5)
        assert out.metrics[0].value == pytest.approx(ref_loss, rel=1e-5)
        opt.step()
    got, want = _state(trainer, sessions[arch], run.run_id), get_peft_model_state_dict(ref)
    # Adam moves each weight by ≲ lr per step; a relative gradient error δ ≈ 1e-5 moves it by ≲ lr·δ (except where
    # |g| ≲ eps): two steps at 1e-2 → 2e-7, plus the rounding of values of size ~1e-1: atol 2e-6
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-6)
    # the experts really trained: B starts at 0 and every expert's B gets a gradient once a token is routed to it
    moved = [k for k in _expert_keys(got) if "lora_B" in k and got[k].abs().max() > 1e-3]
    assert len(moved) == 2 * LAYERS, moved
    run.delete()


def test_two_runs_never_use_each_others_expert_lora(client, trainer, sessions):
    """Run a trains its experts' pairs hard while run b has taken a step: b's adapter, optimizer state and log-probs
    are bit for bit what they were (a's pairs never enter b's step), and a's forward differs from b's."""
    sid = sessions["qwen3_moe"]
    runs_core = trainer[1].runs
    a = client.create_training_run(sid, RunLora(**LORA, seed=1))
    b = client.create_training_run(sid, RunLora(**LORA, seed=2))
    b.forward_backward([ce_datum(SEQ2)])
    b.optim_step(AdamParams(learning_rate=1e-2))
    b_state = _state(trainer, sid, b.run_id)
    rb = runs_core._runs[b.run_id]
    b_opt = step_ops.optimizer_tensors(rb.optimizer, rb.param_names)
    b_lps = b.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs
    a_before = _state(trainer, sid, a.run_id)
    for _ in range(3):
        a.forward_backward([ce_datum(SEQ)])
        a.optim_step(AdamParams(learning_rate=5e-2))
    a.forward_backward([ce_datum(SEQ)])  # a's gradients pending while b runs
    a_after = _state(trainer, sid, a.run_id)
    assert all((a_after[k] - a_before[k]).abs().max() > 1e-2 for k in _expert_keys(a_after) if "lora_B" in k)
    assert b.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs == b_lps, (
        "a's expert pairs entered b's step"
    )
    b_after = _state(trainer, sid, b.run_id)
    assert all(torch.equal(b_state[k], b_after[k]) for k in b_state)
    after_opt = step_ops.optimizer_tensors(rb.optimizer, rb.param_names)
    assert all(torch.equal(b_opt[k], after_opt[k]) for k in b_opt)
    assert all(p.grad is None for p in rb.params), "a's backward put gradients into b's parameters"
    assert a.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs != b_lps
    a.delete()
    b.delete()


def test_the_sampler_samples_with_the_runs_expert_lora(client, trainer, sessions, model_root):
    """A trained run's sampler snapshot: its prompt log-probs equal Forward's and HF + PEFT's over the run's saved
    adapter, and zeroing that adapter's expert B factors moves them far beyond that agreement (the expert pairs are
    in what the sampler computes); a sampled sequence's log-probs are Forward's."""
    sid = sessions["mixtral"]
    run = client.create_training_run(sid, RunLora(**LORA, seed=9))
    for _ in range(3):
        run.forward_backward([ce_datum(SEQ)])
        run.optim_step(AdamParams(learning_rate=5e-2))
    snap = run.save_weights_for_sampler("mixtral-sampler")
    prompt = SEQ[:8]
    out = run.sample(
        prompt, 2, SamplingParams(max_tokens=4, seed=4), sampler_id=snap.sampler_id, prompt_logprobs=True
    )
    got = torch.tensor(out.prompt_logprobs[1:])
    datum = Datum.of(prompt[:-1], target_tokens=prompt[1:], weights=[0.0] * (len(prompt) - 1))
    forward = torch.tensor(run.forward([datum]).loss_fn_outputs[0].logprobs)
    ref = _reference(model_root, "mixtral", _artifact_dir(trainer, run, snap.artifact_id)).eval()
    with torch.no_grad():
        want = _ref_logps(ref, datum)
        for name, p in ref.named_parameters():
            if ".experts." in name and "lora_B" in name:
                p.zero_()
        without_experts = _ref_logps(ref, datum)
    # fp32, a KV-cache prefill vs full forwards: rounding only (1e-5 nats, as the dense sampler test)
    torch.testing.assert_close(got, forward, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - without_experts).abs().max() > 1e-3, "the expert pairs moved nothing the sampler computes"
    for s in out.sequences:
        full = prompt + s.tokens
        d = Datum.of(full[:-1], target_tokens=full[1:], weights=[0.0] * (len(full) - 1))
        lp = run.forward([d]).loss_fn_outputs[0].logprobs[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lp), rtol=1e-5, atol=1e-5)
    run.delete()


@pytest.mark.parametrize("quantization", [Quantization.NONE, Quantization.NF4], ids=["16-bit", "nf4-experts"])
def test_the_grouped_expert_gemm_computes_with_whichever_run_is_active(
    client, caplog, monkeypatch, quantization
):
    """Two runs on a Qwen3-MoE session with strop's kernels (the grouped expert GEMM, the Triton interpreter on the
    CPU) give the losses and log-probs the same runs give on HF's path, alternating between them, with no fallback
    to HF's expert loop: the GEMM reads the active run's expert pairs on every call. NF4 on load: the experts are
    strop's NF4 stacks, dequantized in the GEMM on one session and for each call of HF's loop on the other."""
    from strop.kernels.lora import moe as lora_moe

    calls = []
    grouped = lora_moe.lora_moe_experts

    def counted(*args, **kwargs):
        calls.append(args[3][1].data_ptr())  # the active run's gate_up A, as the GEMM got it
        return grouped(*args, **kwargs)

    monkeypatch.setattr(lora_moe, "lora_moe_experts", counted)  # read when the experts are patched
    out = {}
    for mode in (KernelMode.ON, KernelMode.OFF):
        sess = client.load_model("qwen3_moe", quantization=quantization, dtype="float32", kernels=mode)
        assert sess.facts.kernels_enabled == (mode is KernelMode.ON)
        nf4 = quantization is Quantization.NF4
        assert ("experts held in NF4" in sess.facts.kernels_reason) == nf4, sess.facts.kernels_reason
        runs = [client.create_training_run(sess.session_id, RunLora(**LORA, seed=s)) for s in (11, 12)]
        losses = []
        for run, seq in zip(runs, (SEQ, SEQ2), strict=True):
            for _ in range(2):
                losses.append(run.forward_backward([ce_datum(seq)]).metrics[0].value)
                run.optim_step(AdamParams(learning_rate=3e-2))
        # alternate: a, b, a on the same sequence (a stale pair would show as b's numbers in a's place)
        lps = [runs[i].forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs for i in (0, 1, 0)]
        assert lps[0] == lps[2] and lps[0] != lps[1]
        if mode is KernelMode.ON:
            # every MoE layer of every forward (four ForwardBackward, no recompute on the CPU, three Forward) ran
            # the grouped GEMM, each with its run's own pair: two distinct A stacks per layer
            assert len(calls) == LAYERS * (4 + 3) and len(set(calls)) == 2 * LAYERS, calls
        out[mode] = losses, lps
        client.close_session(sess.session_id)
    # fp32 kernels against torch: ≈1e-5 relative (DESIGN.md's fp32 bound), here over two training steps of each run
    assert out[KernelMode.ON][0] == pytest.approx(out[KernelMode.OFF][0], rel=1e-4)
    for got, want in zip(out[KernelMode.ON][1], out[KernelMode.OFF][1], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    assert out[KernelMode.ON] != out[KernelMode.OFF], (
        "the patched path's rounding differs from torch's somewhere"
    )
    fallbacks = [r.getMessage() for r in caplog.records if "reference path for" in r.getMessage()]
    assert not fallbacks, fallbacks
    logging.getLogger("strop.kernels").warning(
        "strop.kernels: reference path for probe"
    )  # the check can see one
    assert any("reference path for probe" in r.getMessage() for r in caplog.records)


def test_a_run_on_experts_an_earlier_run_left_out_still_gets_the_grouped_gemm(client, trainer, monkeypatch):
    """The kernels are patched when a session's first run is created; a first run without expert LoRA
    (``train_mlp=False``) leaves the experts unwrapped then, so the next run's wrapping patches the model again: its
    experts run on the grouped GEMM (counted) with the numbers the same two runs give on HF's path, the first run's
    calls take HF's loop without a pair, and the session's facts carry one current summary."""
    from strop.kernels.lora import moe as lora_moe

    calls = []
    grouped = lora_moe.lora_moe_experts
    monkeypatch.setattr(lora_moe, "lora_moe_experts", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    out = {}
    for mode in (KernelMode.ON, KernelMode.OFF):
        sess = client.load_model("qwen3_moe", quantization=Quantization.NONE, dtype="float32", kernels=mode)
        first = client.create_training_run(sess.session_id, RunLora(**LORA, train_mlp=False, seed=1))
        assert first.info.target_modules == list(step_ops.ATTN_MODULES)
        second = client.create_training_run(sess.session_id, RunLora(**LORA, seed=2))
        losses = []
        for run in (first, second, first, second):
            losses.append(run.forward_backward([ce_datum(SEQ)]).metrics[0].value)
            run.optim_step(AdamParams(learning_rate=3e-2))
        out[mode] = losses
        if mode is KernelMode.ON:
            # the second run's two ForwardBackward, one call a MoE layer each; none for the first run's
            assert len(calls) == 2 * LAYERS, calls
            reason = _loaded(trainer, sess.session_id).facts.kernels_reason
            assert reason.count("lora_mlp") == 1 and f"lora_mlp patched {LAYERS}/{LAYERS}" in reason, reason
        client.close_session(sess.session_id)
    # fp32 kernels against torch: ≈1e-5 relative (DESIGN.md's fp32 bound), over two steps of each run
    assert out[KernelMode.ON] == pytest.approx(out[KernelMode.OFF], rel=1e-4)


@pytest.mark.parametrize("quantization", [Quantization.NONE, Quantization.NF4], ids=["16-bit", "nf4-experts"])
def test_a_runs_saved_adapter_exports_merged_and_verified_as_trained(
    client, trainer, model_root, quantization
):
    """A trained Qwen3-MoE run's SaveWeights artifact exported to merged fp32 safetensors (per-expert names; and, on
    a 16-bit session, a PEFT adapter), each verified by the exporter in its consumer against the model as trained;
    the merged model's log-probs are the run's own Forward's, so the expert pairs are in the merge. NF4 on load: the
    merge goes into the NF4 experts the run trained over, their codes re-created bit for bit."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from strop.common.export_types import ExportRequest, ExportTarget, ExportTargetKind
    from strop.export_svc.core.pipeline import run_export

    sid = client.load_model("qwen3_moe", quantization=quantization, dtype="float32").session_id
    nf4 = quantization is Quantization.NF4
    run = client.create_training_run(
        sid, RunLora(**LORA, train_unembed=True, seed=5)
    )  # Tinker's default targets
    for _ in range(3):
        run.forward_backward([ce_datum(SEQ)])
        run.optim_step(AdamParams(learning_rate=5e-2))
    saved = run.save_weights(f"qwen3-moe-run-{quantization.name.lower()}")
    k = ExportTargetKind
    targets = [ExportTarget(kind=k.MERGED_SAFETENSORS, dtype="float32")]
    if not nf4:  # PEFT's own load of the adapter is onto the 16-bit checkpoint
        targets.append(ExportTarget(kind=k.PEFT_ADAPTER))
    store = trainer[1].runs.artifacts
    req = ExportRequest(targets=targets, adapter_artifact_id=saved.artifact_id)
    by = {r.target.kind: r for r in run_export(req, model_root=model_root, store=store)}
    merged = by[k.MERGED_SAFETENSORS]
    # the MoE export tests' bound: the same fp32 function, the LoRA term added in another order (~1e-6 of logits)
    assert merged.verification.max_abs_logit_delta < 1e-4
    assert merged.verification.as_trained.max_abs_logit_delta < 1e-4
    if nf4:
        codes = merged.artifact.metadata["merge.nf4_expert_codes"]
        assert codes.startswith("bit-identical to the trainer's"), codes
    else:
        assert by[k.PEFT_ADAPTER].verification.max_abs_logit_delta < 1e-4
    d = store.path_of(merged.artifact.artifact_id)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        got = _ref_logps(model, ce_datum(SEQ))
    want = torch.tensor(run.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs)
    # fp32, the merged weights vs the base with the run's pairs unmerged: rounding, ~1e-6 (as the export bound)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    with safe_open(str(d / wm[name]), "pt") as f:
        merged_w = f.get_tensor(name)
    with safe_open(str(model_root / "qwen3_moe" / "model.safetensors"), "pt") as f:
        base_w = f.get_tensor(name)
    # three Adam steps at 5e-2 move each factor by ~0.1: the merged expert moves by far more than rounding
    assert (merged_w - base_w).abs().max() > 1e-3, "the run's expert pair is not in the merged weights"
    client.close_session(sid)


@pytest.mark.parametrize("quantization", [Quantization.NONE, Quantization.NF4], ids=["16-bit", "nf4"])
def test_admission_counts_every_experts_pair_and_its_optimizer_state(
    client, trainer, monkeypatch, quantization
):
    """A run's adapter state is counted from the model's shapes before it is created: the count is the run's
    trainable parameters (the LM head's pair too; 4-bit attention and NF4 experts by their logical shapes), the
    experts' pairs E·r·(H + 2·I_e) + E·r·(I_e + H) a layer among them, at 16 bytes each; on a device with less
    free than that the run is refused."""
    from strop.common.errors import ResourceExhausted
    from strop.trainer_svc.core.runs import run_state_bytes

    sid = client.load_model("qwen3_moe", quantization=quantization, dtype="float32").session_id
    loaded = _loaded(trainer, sid)
    lora = RunLora(rank=8, train_unembed=True, seed=0)
    counted = step_ops.adapter_numel(loaded.model, lora)
    run = client.create_training_run(sid, lora)
    assert run.info.num_trainable_parameters == counted
    state = _state(trainer, sid, run.run_id)
    assert sum(p.numel() for p in trainer[1].runs._runs[run.run_id].params) == counted
    experts = sum(state[k].numel() for k in _expert_keys(state))
    assert experts == LAYERS * E * 8 * ((H + 2 * I_E) + (I_E + H))
    assert run_state_bytes(_loaded(trainer, sid), lora) == 16 * counted, (
        "the same count once the model is wrapped"
    )
    attention_only = step_ops.adapter_numel(loaded.model, replace(lora, train_mlp=False))
    assert counted - attention_only == experts
    # the admission check as on CUDA: free memory one byte short of the state, then just enough
    fake = SimpleNamespace(loaded=SimpleNamespace(device="cuda:0", model=_loaded(trainer, sid).model))
    need = 16 * counted
    for free, refused in ((need - 1, True), (need, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d, f=free: (f, 2 * need))
        if refused:
            with pytest.raises(ResourceExhausted, match="rank-8 run's adapter state"):
                trainer[1].runs._admit_run(fake, lora)
        else:
            trainer[1].runs._admit_run(fake, lora)
    client.close_session(sid)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_on_cuda_runs_train_expert_lora_over_nf4_experts_on_the_grouped_gemm(
    client, trainer, caplog, monkeypatch, arch
):
    """GPU tier: a 4-bit MoE session as the trainer holds one on CUDA (NF4 attention and NF4 experts, bf16 compute,
    kernels on by default) trains two runs through the step API, each ForwardBackward under the jobs' default
    memory mode and every MoE layer on the grouped expert GEMM with the active run's pair (none falls back to HF's
    expert loop): the loss falls, the other run stays bit for bit, the sampler's prompt log-probs are Forward's
    within bf16 rounding, and a run reloaded from its state continues bit for bit on the device."""
    from strop.kernels.lora import moe as lora_moe

    calls = []
    grouped = lora_moe.lora_moe_experts

    def counted(*args, **kwargs):
        calls.append(args[3][1].data_ptr())
        return grouped(*args, **kwargs)

    monkeypatch.setattr(lora_moe, "lora_moe_experts", counted)
    s = client.load_model(arch, quantization=Quantization.NF4, dtype="bfloat16")
    assert s.facts.device.startswith("cuda") and s.facts.kernels_enabled
    assert "experts held in NF4" in s.facts.kernels_reason, s.facts.kernels_reason
    # rank 8: bf16 factors' rows are 16 bytes, which torch's grouped GEMM takes (rank 4 runs its per-expert loop)
    a = client.create_training_run(s.session_id, RunLora(rank=8, seed=0))
    b = client.create_training_run(s.session_id, RunLora(rank=8, seed=1))
    b_before = b.forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs
    prompt = SEQ[:8]
    datum = Datum.of(prompt[:-1], target_tokens=prompt[1:], weights=[0.0] * (len(prompt) - 1))
    lp_before = torch.tensor(a.forward([datum]).loss_fn_outputs[0].logprobs)
    losses = []
    for _ in range(10):
        losses.append(a.forward_backward([ce_datum(SEQ)]).metrics[0].value)
        a.optim_step(AdamParams(learning_rate=1e-2))
    # the same loop on the CPU (bf16 compute, NF4 experts; the grouped GEMM or HF's path alike) goes 115.8 → 95.9
    # nats, below 0.9× from step 5 on (2e-2 oscillates near 107)
    assert losses[-1] < 0.9 * losses[0], losses
    assert "memory mode STANDARD" in _loaded(trainer, s.session_id).extra["step_memory_mode"]
    assert calls and len(set(calls)) >= 2 * LAYERS, "both runs' pairs went through the grouped GEMM"
    b_after = b.forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs
    torch.testing.assert_close(torch.tensor(b_after), torch.tensor(b_before), rtol=0, atol=1e-6)
    snap = a.save_weights_for_sampler()
    out = a.sample(
        prompt, 2, SamplingParams(max_tokens=4, seed=1), sampler_id=snap.sampler_id, prompt_logprobs=True
    )
    forward = torch.tensor(a.forward([datum]).loss_fn_outputs[0].logprobs)
    # bf16 rounds each product to 2^-8 relative: a prefill and a full forward, rounding in other places, stay within
    # 0.1 nats, well under what ten steps on these very tokens moved them (~1 nat a token on the CPU in fp32)
    assert (forward - lp_before).abs().max() > 0.5
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), forward, rtol=0, atol=0.1)
    saved = a.save_state(f"gpu-moe-state-{arch}")
    for _ in range(2):
        a.forward_backward([ce_datum(SEQ2)])
        a.optim_step(AdamParams(learning_rate=1e-2))
    want = a.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs
    c = client.create_training_run(s.session_id, from_state=saved.artifact_id)
    for _ in range(2):
        c.forward_backward([ce_datum(SEQ2)])
        c.optim_step(AdamParams(learning_rate=1e-2))
    assert c.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs == want
    fallbacks = [r.getMessage() for r in caplog.records if "reference path for" in r.getMessage()]
    # the patched experts module is PEFT's outer ParamWrapper: a fallback of the grouped GEMM names it
    assert not any("ParamWrapper" in f for f in fallbacks), fallbacks
    client.close_session(s.session_id)
