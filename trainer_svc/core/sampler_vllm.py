"""An external vLLM server as the sampler of snapshots (design: docs/sampler.md). Client side only; optional.

``VLLMSampler(base_url)`` loads a snapshot's PEFT adapter directory into a running ``vllm serve --enable-lora``
(``POST /v1/load_lora_adapter``, the server started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; the path must be
visible to the server, e.g. the artifact store's volume mounted there), samples through ``POST /v1/completions``
with token-id prompts, and returns the in-process sampler's types (``sampler.SampleResult``). Tested against a
stdlib stub that answers in vLLM's documented shape; never run against a real vLLM server (none runs here).

Semantics kept equal to ``sampler.sample``: raw-logit log-probs (vLLM's default ``--logprobs-mode raw_logprobs``),
the stop token or the token completing a stop string included (``include_stop_str_in_output``), Tinker's
``stop=[]`` as ``ignore_eos``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from strop.common.errors import FailedPrecondition, InvalidArgument, Unavailable

from .sampler import SampledSequence, SampleRequest, SampleResult, StopReason

__all__ = ["VLLMSampler"]


class VLLMSampler:
    """A vLLM server's OpenAI-compatible API as a sampler of LoRA snapshots."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _post(self, path: str, body: dict) -> dict | str:
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if 400 <= exc.code < 500:
                raise InvalidArgument(f"vLLM refused {path} ({exc.code}): {detail}") from None
            raise Unavailable(f"vLLM failed {path} ({exc.code}): {detail}") from None
        except urllib.error.URLError as exc:
            raise Unavailable(f"vLLM at {self.base_url} is unreachable: {exc.reason}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # the LoRA endpoints answer plain text

    def load(self, name: str, adapter_dir: str) -> None:
        """Make the PEFT adapter at ``adapter_dir`` (a path on the server) sampleable as model ``name``."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})

    def unload(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def sample(
        self, model: str, requests: list[SampleRequest], *, eos_token_ids=(), use_eos: bool = True
    ) -> list[SampleResult]:
        """One completions call per request, against adapter (or base) ``model``.

        ``use_eos=False`` is Tinker's ``stop=[]`` (no implicit EOS); ``eos_token_ids`` are sent as stop tokens too.
        """
        return [self._sample_one(model, r, eos_token_ids, use_eos) for r in requests]

    def _sample_one(self, model: str, r: SampleRequest, eos_token_ids, use_eos: bool) -> SampleResult:
        p = r.params
        body = {
            "model": model,
            "prompt": list(r.prompt),
            "n": r.num_samples,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "stop": list(p.stop_strings),
            "stop_token_ids": sorted(set(p.stop_token_ids) | set(eos_token_ids)),
            "ignore_eos": not use_eos,
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if r.prompt_logprobs:
            body["prompt_logprobs"] = 0
        reply = self._post("/v1/completions", body)
        if not isinstance(reply, dict) or "choices" not in reply:
            raise FailedPrecondition(f"vLLM answered /v1/completions without choices: {str(reply)[:200]}")
        choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
        seqs = [_sequence(c) for c in choices]
        prompt_lps = (
            _prompt_logprobs(choices[0].get("prompt_logprobs"), r.prompt) if r.prompt_logprobs else None
        )
        return SampleResult(seqs, prompt_lps)


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise FailedPrecondition(
            f"vLLM returned token {token!r}, not 'token_id:<n>' (return_tokens_as_token_ids)"
        )
    return int(token.split(":", 1)[1])


def _sequence(choice: dict) -> SampledSequence:
    lp = choice.get("logprobs") or {}
    tokens = [_token_id(t) for t in lp.get("tokens", [])]
    logprobs = [float(x) for x in lp.get("token_logprobs", [])]
    reason = StopReason.LENGTH if choice.get("finish_reason") == "length" else StopReason.STOP
    return SampledSequence(tokens, logprobs, str(reason))


def _prompt_logprobs(entries: list | None, prompt: list[int]) -> list[float | None]:
    """vLLM's prompt_logprobs (None, then one {token_id: {logprob, ...}} per position, the prompt's own token among
    them) as the prompt token's log-prob per position."""
    if not entries or len(entries) != len(prompt):
        raise FailedPrecondition(
            f"vLLM returned {len(entries or [])} prompt log-probs for {len(prompt)} tokens"
        )
    out: list[float | None] = [None]
    for tok, entry in zip(prompt[1:], entries[1:], strict=True):
        item = entry.get(str(tok)) if entry else None
        if item is None:
            raise FailedPrecondition(f"vLLM's prompt log-probs lack the prompt token {tok}")
        out.append(float(item["logprob"] if isinstance(item, dict) else item))
    return out
