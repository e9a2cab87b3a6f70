"""``VLLMSampler`` (trainer_svc/core/sampler_vllm.py) against a stdlib HTTP stub answering in vLLM's documented
shape: the requests it sends and how it reads replies. Not a test of vLLM itself (none runs here)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strop.common.errors import InvalidArgument
from strop.trainer_svc.core.sampler import SampleRequest, SamplingParams
from strop.trainer_svc.core.sampler_vllm import VLLMSampler


@pytest.fixture
def stub():
    seen: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if self.path == "/v1/load_lora_adapter" and body["lora_name"] == "bad":
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b"adapter rank 512 above max_lora_rank 64")
                return
            if self.path.endswith("_lora_adapter"):
                reply = b"Success"
            else:
                choices = [
                    {
                        "index": 1,
                        "finish_reason": "length",
                        "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -1.5]},
                    },
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.25]},
                        "prompt_logprobs": [
                            None,
                            {"4": {"logprob": -2.0, "rank": 3}, "1": {"logprob": -0.1}},
                            {"5": {"logprob": -3.0}},
                        ],
                    },
                ]
                reply = json.dumps({"object": "text_completion", "choices": choices}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_vllm_sampler_loads_then_samples_with_token_ids_and_raw_logprobs(stub):
    url, seen = stub
    s = VLLMSampler(url)
    s.load("run1-snap3", "/store/run1/snap3")
    params = SamplingParams(
        max_tokens=2, temperature=0.7, top_k=-1, stop_token_ids=(2,), stop_strings=("\n",), seed=5
    )
    (res,) = s.sample(
        "run1-snap3", [SampleRequest([3, 4, 5], 2, params, prompt_logprobs=True)], eos_token_ids=(1,)
    )
    assert seen[0] == ("/v1/load_lora_adapter", {"lora_name": "run1-snap3", "lora_path": "/store/run1/snap3"})
    path, body = seen[1]
    assert path == "/v1/completions"
    assert body["prompt"] == [3, 4, 5] and body["n"] == 2 and body["seed"] == 5 and body["stop"] == ["\n"]
    assert body["stop_token_ids"] == [1, 2] and body["include_stop_str_in_output"] is True
    assert (
        body["return_tokens_as_token_ids"] is True and body["logprobs"] == 0 and body["prompt_logprobs"] == 0
    )
    # choices come back in index order, token ids parsed, finish reasons mapped
    assert [q.tokens for q in res.sequences] == [[9], [7, 8]]
    assert [q.logprobs for q in res.sequences] == [[-0.25], [-0.5, -1.5]]
    assert [q.stop_reason for q in res.sequences] == ["stop", "length"]
    assert res.prompt_logprobs == [None, -2.0, -3.0]


def test_vllm_refusal_is_invalid_argument_with_its_message(stub):
    url, _ = stub
    with pytest.raises(InvalidArgument, match="max_lora_rank"):
        VLLMSampler(url).load("bad", "/x")
