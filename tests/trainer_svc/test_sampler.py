"""The step API's sampler (``trainer_svc/core/sampler.py``) against transformers + PEFT on a tiny fp32 model.

Bounds. Everything runs in fp32 on the CPU. The sampler's log-probs come from the cached decode path (a grouped
attention over a static cache, one query at a time); the references from one full forward over the whole sequence.
Both compute the same sums in different orders, so they differ by fp32 rounding accumulated over the model: each of
the ~10 matmul/softmax stages contributes a relative error of about sqrt(K)·2^-24 (K ≤ 512 here, ≈1.4e-6), and a
log-softmax of logits of size ~1-10 turns that into an absolute error of order 1e-5. The tolerance is 1e-4 absolute:
ten times that estimate, and four orders below the spread of the log-probs compared (several nats). Token-for-token
equality with ``generate`` holds unless two logits tie within that error, which these prompts do not.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

from strop.trainer_svc.core.sampler import SampleRequest, SampleStats, SamplingParams, sample

TOL = 1e-4  # see the module docstring


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (fp32) with a LoRA adapter whose B is not zero, so the adapter changes every logit."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("sampler") / "tiny", arch="llama", dtype="float32", seed=0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, cfg)
    model.train()  # as a training run leaves it; the sampler must put it back
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


PROMPTS = [[5, 17, 42, 99, 7], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16]]


def full_logprobs(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[i] | seq[:i]) for i >= 1, from one forward over the whole sequence."""
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    model.train(was)
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_greedy_equals_generate_on_ragged_prompts(tiny):
    """Three prompts of 5, 2 and 9 tokens in one left-padded batch decode exactly what ``generate`` (greedy, one
    prompt at a time, no padding) decodes for each."""
    model, _ = tiny
    params = SamplingParams(max_tokens=12, temperature=0.0)
    got = sample(model, [SampleRequest(p, 1, params) for p in PROMPTS])
    model.eval()
    for p, res in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            ref = model.generate(
                input_ids=torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert res.sequences[0].tokens == ref
        assert res.sequences[0].stop_reason == "length"
    model.train()


def test_sampled_logprobs_equal_a_full_forward(tiny):
    """Each sampled token's log-prob is the raw (temperature 1, no top-k/p) log-softmax of a full forward at its
    position, whatever the temperature and filters that chose it."""
    model, _ = tiny
    reqs = [
        SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=10, temperature=1.3, seed=3)),
        SampleRequest(
            PROMPTS[1], 1, SamplingParams(max_tokens=10, temperature=0.7, top_k=5, top_p=0.9, seed=4)
        ),
    ]
    for req, res in zip(reqs, sample(model, reqs), strict=True):
        assert len(res.sequences) == req.num_samples
        for s in res.sequences:
            ref = full_logprobs(model, req.prompt + s.tokens)[len(req.prompt) - 1 :]
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOL, rtol=0), (s.logprobs, ref.tolist())


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the split kernel runs under the interpreter"
)
def test_decode_attention_split_over_keys_gives_the_same_samples(tiny, monkeypatch):
    """The decode attention as it runs on CUDA (kernels/ops/decode_attention.py's kernel, taken here under the
    Triton interpreter): every step's attention goes through it, and the sampled tokens and log-probs are those of a
    full forward (TOL: fp32 rounding) and of the SDPA path, ragged samples (2 and 1) included."""
    import strop.kernels.ops.decode_attention as kernel
    from strop.trainer_svc.core import decode_step

    model, _ = tiny
    reqs = [
        SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=5, temperature=1.0, seed=5)),
        SampleRequest(PROMPTS[1], 1, SamplingParams(max_tokens=5, temperature=0.0)),
    ]
    sdpa = sample(model, reqs)
    calls = []
    real = kernel.decode_attention
    monkeypatch.setattr(decode_step, "split_over_keys", kernel.decode_attention_can_run)
    monkeypatch.setattr(kernel, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    split = sample(model, reqs)
    layers = model.config.num_hidden_layers
    assert decode_step.SPLIT_REFUSED == {}  # the first call's comparison with SDPA passed
    assert len(calls) == 4 * layers  # steps 1-4 (step 0's token comes from the prefill)
    for req, a, b in zip(reqs, split, sdpa, strict=True):
        for s, t in zip(a.sequences, b.sequences, strict=True):
            assert s.tokens == t.tokens
            ref = full_logprobs(model, req.prompt + s.tokens)[len(req.prompt) - 1 :]
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOL, rtol=0), (s.logprobs, ref.tolist())


def test_a_split_kernel_that_disagrees_with_sdpa_is_refused(tiny, monkeypatch):
    """The split decode attention's first call on a device is checked against SDPA: a kernel returning wrong
    values (zeros here) is refused for the process with the reason kept, and SDPA serves the call, which samples
    what the SDPA path samples."""
    import strop.kernels.ops.decode_attention as kernel
    from strop.trainer_svc.core import decode_step

    model, _ = tiny
    reqs = [SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=3, temperature=0.0))]
    sdpa = sample(model, reqs)
    monkeypatch.setattr(decode_step, "SPLIT_REFUSED", {})
    monkeypatch.setattr(decode_step, "_SPLIT_CHECKED", set())
    monkeypatch.setattr(decode_step, "split_over_keys", lambda q, k, v: True)
    monkeypatch.setattr(kernel, "decode_attention", lambda q, k, v, *a, **kw: q.new_zeros(q.shape))
    got = sample(model, reqs)
    assert "differs from SDPA" in decode_step.SPLIT_REFUSED["cpu"]
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in sdpa[0].sequences]


def test_prompt_logprobs_equal_a_full_forward(tiny):
    """Prompt log-probs: None first, then log p(prompt[i] | prompt[:i]) of a full forward; for the shorter prompt
    of a padded batch too."""
    model, _ = tiny
    params = SamplingParams(max_tokens=1, temperature=0.0)
    got = sample(model, [SampleRequest(p, 1, params, prompt_logprobs=True) for p in PROMPTS[:2]])
    for p, res in zip(PROMPTS[:2], got, strict=True):
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(p)
        assert torch.allclose(
            torch.tensor(res.prompt_logprobs[1:]), full_logprobs(model, p), atol=TOL, rtol=0
        )


def test_an_unpadded_prefill_runs_the_causal_kernel_with_the_same_logprobs(tiny):
    """One request (no padding) prefills through SDPA's causal kernel with no mask built; two prompts of different
    lengths through the masked path. Either way the prompt's and the samples' log-probs are a full forward's."""
    model, _ = tiny
    for prompts, how in [([PROMPTS[2]], "causal"), (PROMPTS[:2], "masked")]:
        stats = SampleStats()
        reqs = [
            SampleRequest(p, 2, SamplingParams(max_tokens=6, seed=5), prompt_logprobs=True) for p in prompts
        ]
        got = sample(model, reqs, stats=stats)
        assert stats.extra["prefill"] == how
        for p, res in zip(prompts, got, strict=True):
            ref = full_logprobs(model, p)
            assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), ref, atol=TOL, rtol=0)
            for s in res.sequences:
                ref = full_logprobs(model, p + s.tokens)[len(p) - 1 :]
                assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOL, rtol=0)


def test_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(tiny):
    """A seeded request samples the same tokens alone and beside other requests (its noise comes from its own
    generator), and a different seed samples differently."""
    model, _ = tiny
    mine = SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=16, temperature=1.0, seed=123))
    alone = sample(model, [mine])[0]
    other = SampleRequest(PROMPTS[2], 3, SamplingParams(max_tokens=5, temperature=0.9, seed=7))
    greedy = SampleRequest(PROMPTS[1], 1, SamplingParams(max_tokens=20, temperature=0.0))
    crowded = sample(model, [other, mine, greedy])[1]
    assert [s.tokens for s in crowded.sequences] == [s.tokens for s in alone.sequences]
    reseeded = sample(model, [SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=16, seed=124))])[0]
    assert [s.tokens for s in reseeded.sequences] != [s.tokens for s in alone.sequences]
    # two samples of one request are different draws (16 tokens from a near-flat 640-way distribution)
    assert alone.sequences[0].tokens != alone.sequences[1].tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gemma2"])
def test_samples_share_their_prompts_cache_and_each_sees_only_its_own_tokens(arch, tmp_path):
    """Requests of 3 and 2 samples with prompts of 9 and 2 tokens (left-padded), 20 tokens each: the cache holds each
    prompt once and a block of slots per sample (2 x (9 + 3 x 20) slots, not 5 x (9 + 20)), and every sampled
    log-prob is a full forward's over that sample's own sequence — on Llama, on Gemma 3 (a 16-token sliding window
    on five of six layers: the window slides over the prompt and the sample's block) and on Gemma 2 (attention
    soft-capping: the decode attention's explicit path)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, dtype="float32", seed=0)
    impl = "eager" if arch == "gemma2" else "sdpa"  # HF's SDPA refuses Gemma 2's soft-cap
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
    torch.manual_seed(2)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    reqs = [
        SampleRequest(PROMPTS[2], 3, SamplingParams(max_tokens=20, temperature=1.0, seed=8)),
        SampleRequest(PROMPTS[1], 2, SamplingParams(max_tokens=20, temperature=1.0, seed=9)),
    ]
    stats = SampleStats()
    got = sample(model, reqs, stats=stats)
    assert stats.extra["kv_cache_slots"] == 2 * (len(PROMPTS[2]) + 3 * 20)
    for req, res in zip(reqs, got, strict=True):
        assert len(res.sequences) == req.num_samples
        assert len({tuple(s.tokens) for s in res.sequences}) == req.num_samples  # different draws
        for s in res.sequences:
            ref = full_logprobs(model, req.prompt + s.tokens)[len(req.prompt) - 1 :]
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=TOL, rtol=0), (s.logprobs, ref.tolist())


def test_top_k_one_is_greedy(tiny):
    model, _ = tiny
    greedy = sample(model, [SampleRequest(PROMPTS[2], 1, SamplingParams(max_tokens=10, temperature=0.0))])
    top1 = sample(
        model, [SampleRequest(PROMPTS[2], 2, SamplingParams(max_tokens=10, temperature=2.0, top_k=1))]
    )
    assert all(s.tokens == greedy[0].sequences[0].tokens for s in top1[0].sequences)


def test_stop_token_ends_the_sequence_and_is_included(tiny):
    """The greedy continuation's 4th token, named as a stop token, ends the sequence there, included, reason
    "stop"; the same via eos_token_ids; a sequence that never meets it runs to max_tokens ("length")."""
    model, _ = tiny
    free = sample(model, [SampleRequest(PROMPTS[0], 1, SamplingParams(max_tokens=10, temperature=0.0))])[0]
    toks = free.sequences[0].tokens
    stop = toks[3]
    k = toks.index(stop)  # its first occurrence
    got = sample(model, [SampleRequest(PROMPTS[0], 1, SamplingParams(10, 0.0, stop_token_ids=(stop,)))])[0]
    assert got.sequences[0].tokens == toks[: k + 1] and got.sequences[0].stop_reason == "stop"
    assert got.sequences[0].logprobs == pytest.approx(free.sequences[0].logprobs[: k + 1], abs=TOL)
    via_eos = sample(model, [SampleRequest(PROMPTS[0], 1, SamplingParams(10, 0.0))], eos_token_ids=(stop,))[0]
    assert via_eos.sequences[0].tokens == toks[: k + 1]
    never = next(t for t in range(640) if t not in toks)
    got = sample(model, [SampleRequest(PROMPTS[0], 1, SamplingParams(10, 0.0, stop_token_ids=(never,)))])[0]
    assert got.sequences[0].tokens == toks and got.sequences[0].stop_reason == "length"


def test_stop_string_ends_at_the_token_that_completes_it(tiny):
    """A stop string taken from the decoded greedy continuation ends the sequence at the first token whose text
    completes it (that token kept), even when found between host checks (check_every=4)."""
    model, tok = tiny
    free = sample(model, [SampleRequest(PROMPTS[1], 1, SamplingParams(max_tokens=20, temperature=0.0))])[0]
    toks = free.sequences[0].tokens
    k = next(i for i in range(5, 20) if tok.decode(toks[i : i + 1]).strip())  # a token with visible text
    text = tok.decode(toks[: k + 1])
    stop = text[-2:] if len(tok.decode(toks[k : k + 1])) >= 2 else text[-1:]
    first = next(i for i in range(len(toks)) if stop in tok.decode(toks[: i + 1]))
    got = sample(
        model,
        [SampleRequest(PROMPTS[1], 1, SamplingParams(20, 0.0, stop_strings=(stop,)))],
        tokenizer=tok,
        check_every=4,
    )[0]
    assert got.sequences[0].tokens == toks[: first + 1]
    assert got.sequences[0].stop_reason == "stop"


def test_model_is_put_back_and_training_is_bitwise_unaffected(tiny):
    """After a sampling call the model is in train mode as before, the attention implementation is the model's,
    and a training step's loss and LoRA gradients are bitwise what they were before the call."""
    model, _ = tiny
    batch = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    impl = model.config._attn_implementation
    flags = [m.training for m in model.modules()]

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        out = [loss.detach().clone()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        return out

    before = grads()
    sample(model, [SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=6, seed=1))])
    after = grads()
    assert [m.training for m in model.modules()] == flags
    assert model.config._attn_implementation == impl
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_bad_requests_are_refused_with_the_field_named(tiny):
    from strop.common.errors import InvalidArgument

    model, _ = tiny
    ok = SamplingParams(max_tokens=4)
    cases = [
        ([SampleRequest([1, 640], 1, ok)], "outside the vocabulary"),
        ([SampleRequest([], 1, ok)], "prompt is empty"),
        ([SampleRequest([1], 0, ok)], "num_samples"),
        ([SampleRequest([1], 1, SamplingParams(0))], "max_tokens"),
        ([SampleRequest([1], 1, SamplingParams(4, temperature=float("nan")))], "temperature"),
        ([SampleRequest([1], 1, SamplingParams(4, top_p=0.0))], "top_p"),
        ([SampleRequest([1], 1, SamplingParams(4, top_k=0))], "top_k"),
        ([SampleRequest([1], 1, SamplingParams(4, stop_strings=("x",)))], "tokenizer"),
        ([SampleRequest([1, 2, 3], 1, SamplingParams(8))], "max length 10"),
        ([], "no sample requests"),
    ]
    for reqs, words in cases:
        with pytest.raises(InvalidArgument, match=words):
            sample(model, reqs, max_length=10)
    assert model.training


def test_stats_count_the_new_tokens(tiny):
    model, _ = tiny
    stats = SampleStats()
    res = sample(model, [SampleRequest(PROMPTS[0], 3, SamplingParams(max_tokens=7, seed=0))], stats=stats)
    assert stats.rows == 3 and stats.new_tokens == sum(len(s.tokens) for s in res[0].sequences) == 21
    assert not stats.cuda_graph  # CPU


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_greedy_equals_generate_on_other_archs(arch, tmp_path):
    """Qwen3 (q/k norms) and Gemma 3 (a 16-token sliding window on five of six layers, scaled embeddings): a 9-token
    prompt decoded 14 tokens past it, so the window slides, matches ``generate`` token for token, and the sampled
    log-probs match a full forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, dtype="float32", seed=0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(2)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    prompts = [PROMPTS[2], PROMPTS[1]]
    got = sample(
        model, [SampleRequest(p, 1, SamplingParams(max_tokens=14, temperature=0.0)) for p in prompts]
    )
    for p, res in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model.generate(
                input_ids=torch.tensor([p]),
                max_new_tokens=14,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert res.sequences[0].tokens == ref
        lp = full_logprobs(model, p + ref)[len(p) - 1 :]
        assert torch.allclose(torch.tensor(res.sequences[0].logprobs), lp, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def nf4_tiny(tmp_path_factory):
    """The tiny Llama quantized to NF4 on load (double quant, fp32 compute) with a LoRA adapter on all seven
    projections (B not zero), 4-bit layers kept out of bitsandbytes' CPU inference layout as a session does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from strop.fixtures import make_tiny_model
    from strop.trainer_svc.core.model_loading import keep_4bit_layers_trainable

    path = make_tiny_model(tmp_path_factory.mktemp("nf4") / "tiny", arch="llama", dtype="float32", seed=0)
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=bnb, device_map="cpu"
    )
    keep_4bit_layers_trainable(base)
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )


def test_nf4_base_decodes_through_the_fused_kernel_as_peft_does(nf4_tiny):
    """On an NF4 base (quantized on load, fp32 compute) every LoRA projection decodes through ``nf4_lora_decode``
    (2 layers x 7 projections swapped), and the tokens and log-probs are PEFT + bitsandbytes' own: greedy tokens
    equal, log-probs within TOL of both the unfused sampler and a full forward."""
    model = nf4_tiny
    # few tokens: the Triton interpreter runs the kernel at ~0.1 s a call (14 a step)
    reqs = [SampleRequest(p, 1, SamplingParams(max_tokens=3, temperature=0.0)) for p in PROMPTS[:2]]
    fused_stats = SampleStats()
    fused = sample(model, reqs, stats=fused_stats, nf4_decode=True)
    plain = sample(model, reqs, nf4_decode=False)
    assert fused_stats.extra["nf4_decode_layers"] == 14
    for p, f, q in zip(PROMPTS[:2], fused, plain, strict=True):
        assert f.sequences[0].tokens == q.sequences[0].tokens
        assert f.sequences[0].logprobs == pytest.approx(q.sequences[0].logprobs, abs=TOL)
        ref = full_logprobs(model, p + f.sequences[0].tokens)[len(p) - 1 :]
        assert torch.allclose(torch.tensor(f.sequences[0].logprobs), ref, atol=TOL, rtol=0)
    assert all("forward" not in m.__dict__ for m in model.modules() if hasattr(m, "lora_A"))  # swaps undone

    # Patched by strop's training kernels (as sessions are on CUDA): the patch passes through while the decode
    # forwards run (its RMSNorms on strop's kernel), and is back on afterwards.
    from strop.kernels.models import patch_model, unpatch_model

    patch_model(model)
    try:
        patched_stats = SampleStats()
        patched = sample(model, reqs, stats=patched_stats, nf4_decode=True)
        assert patched_stats.extra["nf4_decode_layers"] == 14
        for f, q in zip(patched, fused, strict=True):
            assert f.sequences[0].tokens == q.sequences[0].tokens
            assert f.sequences[0].logprobs == pytest.approx(q.sequences[0].logprobs, abs=TOL)
        norm = model.base_model.model.model.norm
        owner = norm.__dict__["_strop_patch_owner"]
        assert owner.active and "_strop_nf4decode_prev" not in norm.__dict__
    finally:
        unpatch_model(model)


@pytest.mark.gpu
def test_cuda_sampler_with_graph_and_nf4_kernel_is_within_bf16_error_of_fp32(tmp_path):
    """GPU tier. On an NF4 session as the trainer has it on CUDA (bf16 compute, strop's kernels patched), the
    decode step runs as a CUDA graph through the fused NF4 kernel, the same seed gives bitwise the same tokens
    twice, the capture frees none of the pinned host allocator's cached blocks (the activation offload's between
    steps), the decode attention is the split kernel (not refused by its check against SDPA), and the sampled
    log-probs are no further from an fp32-compute teacher-forced forward of the same NF4 weights than 2x bf16's own
    error (HF + PEFT + bitsandbytes in bf16 against that fp32 forward): DESIGN.md's bf16 rule."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from strop.fixtures import make_tiny_model
    from strop.kernels.models import patch_model, unpatch_model
    from strop.trainer_svc.core.model_loading import compute_prequantized_in

    path = make_tiny_model(tmp_path / "tiny", arch="llama", dtype="bfloat16", seed=0)
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=bnb, device_map={"": 0}, attn_implementation="sdpa"
    )
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )
    patch_model(model)
    reqs = [
        SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=24, temperature=1.0, seed=11)),
        SampleRequest(PROMPTS[2], 1, SamplingParams(max_tokens=24, temperature=0.0)),
    ]
    stats = SampleStats()
    # a cached pinned block, as the activation offload leaves them between steps: the capture keeps it
    torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)  # dropped at once: its block stays cached
    freed = torch.cuda.host_memory_stats()["num_host_free"]
    got = sample(model, reqs, stats=stats, nf4_decode=True)
    again = sample(model, reqs, nf4_decode=True)
    assert stats.cuda_graph, stats.note
    assert torch.cuda.host_memory_stats()["num_host_free"] == freed
    from strop.trainer_svc.core.decode_step import SPLIT_REFUSED

    assert SPLIT_REFUSED == {}  # the decode attention ran split over the keys (its first call matched SDPA)
    assert stats.extra["nf4_decode_layers"] == 14
    assert [[s.tokens for s in r.sequences] for r in got] == [[s.tokens for s in r.sequences] for r in again]
    unpatch_model(model)

    def teacher_forced(seq: list[int], n_prompt: int) -> torch.Tensor:
        ids = torch.tensor([seq], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, n_prompt - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, n_prompt:, None])[:, 0].cpu()

    pairs = [(r.prompt, s) for r, res in zip(reqs, got, strict=True) for s in res.sequences]
    bf16 = [teacher_forced(p + s.tokens, len(p)) for p, s in pairs]
    compute_prequantized_in(model, torch.float32)  # the same NF4 codes, everything else computed in fp32
    fp32 = [teacher_forced(p + s.tokens, len(p)) for p, s in pairs]
    ours = [torch.tensor(s.logprobs) for _, s in pairs]
    torch_err = max(float((b - f).abs().max()) for b, f in zip(bf16, fp32, strict=True))
    our_err = max(float((o - f).abs().max()) for o, f in zip(ours, fp32, strict=True))
    assert our_err <= 2 * torch_err, (our_err, torch_err)


def test_nf4_kernel_that_disagrees_with_bitsandbytes_is_not_used(nf4_tiny, monkeypatch):
    """The decode forwards first check the kernel against bitsandbytes on one layer: a kernel returning wrong
    values (zeros here) is not swapped in, the call samples through PEFT + bitsandbytes, and the note says why."""
    import strop.kernels.models.decode as decode

    monkeypatch.setattr(decode, "nf4_lora_decode", lambda x, w, *a, **k: torch.zeros(*x.shape[:-1], w.n))
    stats = SampleStats()
    req = [SampleRequest(PROMPTS[1], 1, SamplingParams(max_tokens=3, temperature=0.0))]
    got = sample(nf4_tiny, req, stats=stats, nf4_decode=True)
    assert stats.extra["nf4_decode_layers"] == 0 and "disagrees with bitsandbytes" in stats.note
    assert got[0].sequences[0].tokens == sample(nf4_tiny, req, nf4_decode=False)[0].sequences[0].tokens


def _sixteen_bit_session(tmp_path):
    """A session as the trainer holds one under bf16 compute: a 16-bit base, LoRA factors in fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", arch="llama", dtype="bfloat16", seed=0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(3)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )
    assert (
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype
        == torch.float32
    )
    return model


def test_a_16bit_session_decodes_its_fp32_lora_on_strops_path(tmp_path, monkeypatch):
    """A session as the trainer holds one under bf16 compute (16-bit base, LoRA factors in fp32, strop's kernels
    patched) samples under autocast to bf16, as it trains: every patched LoRA forward of the prefill and of each
    decode step (o_proj, the MLP) runs strop's kernel (counted per call), none falls back to PEFT's reference path
    (without autocast each did: fp32 factors meeting a bf16 input); autocast is off again after the call."""
    import strop.kernels.models.patched_forwards as pf
    from strop.kernels.models import patch_model, unpatch_model
    from strop.kernels.models.patch_state import PatchState

    model = _sixteen_bit_session(tmp_path)
    patch_model(model)
    calls = {"lora_qkv": 0, "lora_linear": 0, "lora_mlp": 0}
    for name in calls:

        def counted(*args, _f=getattr(pf, name), _n=name, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(pf, name, counted)
    fallbacks: list[str] = []
    monkeypatch.setattr(PatchState, "fallback", lambda self, module, reason: fallbacks.append(reason))
    max_tokens = 4
    try:
        got = sample(model, [SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=max_tokens, seed=5))])
    finally:
        unpatch_model(model)
    assert fallbacks == []
    steps = max_tokens  # the prefill gives the first token, then one forward per further token
    layers = model.config.num_hidden_layers
    # q/k/v: a forward with a KV cache runs HF's attention forward (the patched one passes such calls through), its
    # PEFT projections under the same autocast
    assert calls == {"lora_qkv": 0, "lora_linear": layers * steps, "lora_mlp": layers * steps}
    assert all(
        len(s.tokens) == max_tokens and all(math.isfinite(x) for x in s.logprobs) for s in got[0].sequences
    )
    assert not torch.is_autocast_enabled("cpu")


def test_a_16bit_sessions_lora_factors_are_cast_once_for_the_call_and_put_back(tmp_path, monkeypatch):
    """Under bf16 compute the call holds every fp32 LoRA factor cast to bf16 once (seen by a forward hook), so no
    projection casts its factors (nor PEFT its input to their dtype) in each forward: at least 14 casts fewer a
    layer and forward (7 projections x A and B), counted at the dispatcher. The tokens and log-probs are bitwise
    those of the call that casts at each use, and after it every factor is the same fp32 parameter with the same
    values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import strop.trainer_svc.core.sampler as sampler
    from strop.kernels.models import patch_model, unpatch_model

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    model = _sixteen_bit_session(tmp_path)
    patch_model(model)
    factors = [(n, p, p.detach().clone()) for n, p in model.named_parameters() if "lora_" in n]
    q_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    seen: list[torch.dtype] = []
    hook = q_a.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    max_tokens = 4
    reqs = [SampleRequest(PROMPTS[0], 2, SamplingParams(max_tokens=max_tokens, seed=5))]
    try:
        with Casts() as once:
            got = sample(model, reqs)
        kept = list(seen)
        monkeypatch.setattr(sampler, "_lora_factors_in", lambda model, dtype: contextlib.nullcontext())
        with Casts() as each_use:
            ref = sample(model, reqs)
    finally:
        hook.remove()
        unpatch_model(model)
    assert kept and set(kept) == {torch.bfloat16}
    forwards = max_tokens  # the prefill, then one a further token
    assert each_use.n - once.n >= 14 * model.config.num_hidden_layers * forwards, (each_use.n, once.n)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in ref[0].sequences]
    assert [s.logprobs for s in got[0].sequences] == [s.logprobs for s in ref[0].sequences]
    after = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    for (n, p, before), (n2, p2) in zip(factors, after, strict=True):
        assert n == n2 and p is p2 and p.dtype == torch.float32 and torch.equal(p, before), n
