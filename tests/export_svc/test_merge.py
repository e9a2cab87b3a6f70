"""Merge exactness: fp32 math, rsLoRA/DoRA/patterns as PEFT defines them, one cast, shard-by-shard memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
from strop.export_svc.core.adapter_source import open_adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import InvalidArgument
from strop.export_svc.core.hf_dir import write_merged_dir
from strop.export_svc.core.merge import iter_merged
from strop.export_svc.core.pipeline import run_export

from .conftest import copy_tree, fp32_model_from_dir, make_random_adapter, store_is_empty


def _read_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


def _nf4_dequant_by_hand(path: Path, name: str) -> torch.Tensor:
    """NF4 with double quant, computed from the stored pieces without bitsandbytes' kernels.

    value = code[nibble] · absmax[block];  absmax = nested_code[absmax_u8] · nested_absmax[block256] + offset
    (high nibble first within each byte; 64 values per block).
    """
    with safe_open(str(path), "pt") as f:
        packed = f.get_tensor(name).reshape(-1)
        code = f.get_tensor(name + ".quant_map")
        absmax_q = f.get_tensor(name + ".absmax")
        nested_code = f.get_tensor(name + ".nested_quant_map")
        nested_absmax = f.get_tensor(name + ".nested_absmax")
        meta = json.loads(bytes(f.get_tensor(name + ".quant_state.bitsandbytes__nf4").tolist()))
    absmax = (
        nested_code[absmax_q.long()].view(-1, meta["nested_blocksize"]) * nested_absmax.view(-1, 1)
    ).reshape(-1)
    absmax = absmax + meta["nested_offset"]
    nibbles = torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1).long()
    values = code[nibbles].view(-1, meta["blocksize"]) * absmax.view(-1, 1)
    return values.reshape(meta["shape"])


def test_nf4_merge_equals_fp32_dequant_plus_scaled_delta_cast_once(export_models, tmp_path):
    base = BaseModel(export_models / "llama-bpe-nf4", "llama-bpe-nf4")
    adapter = open_adapter(export_models / "llama-bpe-nf4-lora", "lora")
    assert base.quantization == "bnb-nf4" and adapter.use_rslora
    write_merged_dir(tmp_path / "out", base, adapter, base.path, dtype="bfloat16")
    merged = _read_dir(tmp_path / "out")
    src = base.path / "model.safetensors"
    adapted = 0
    with safe_open(str(src), "pt") as f:
        for name, t in base.tensors.items():
            if t.quant:
                w32 = _nf4_dequant_by_hand(src, name)
                # our dequantization (bitsandbytes asked for fp32) is the hand-computed one, bit for bit
                assert torch.equal(base.read_fp32(name), w32), name
            else:
                w32 = f.get_tensor(name).float()
            if name in adapter.modules:
                m = adapter.modules[name]
                a = adapter.read(m.a_key).float()
                b = adapter.read(m.b_key).float()
                s = 16 / math.sqrt(8)  # rsLoRA: alpha / sqrt(r)
                expected = (w32 + s * (b @ a)).to(torch.bfloat16)
                adapted += 1
            else:
                expected = w32.to(torch.bfloat16)
            assert merged[name].dtype == torch.bfloat16
            assert torch.equal(merged[name], expected), f"{name}: merged weight is not cast(W32 + s·B@A)"
    assert adapted == 14, "all seven projections of both layers are adapted"


@pytest.mark.parametrize(
    "kind",
    ["plain", "rslora_with_patterns", "dora"],
)
def test_the_streaming_merge_matches_peft_merge_and_unload_in_fp32(export_models, tmp_path, kind):
    from peft import PeftModel

    kw = {
        "plain": {},
        "rslora_with_patterns": dict(
            use_rslora=True, rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 32}
        ),
        "dora": dict(use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    }[kind]
    base_dir = export_models / "qwen2-bpe"
    adir = make_random_adapter(base_dir, tmp_path / "lora", seed=3, **kw)
    reference = PeftModel.from_pretrained(fp32_model_from_dir(base_dir), adir).merge_and_unload()
    want = reference.state_dict()
    base = BaseModel(base_dir, "qwen2")
    adapter = open_adapter(adir, "lora")
    base_sd = {n: base.read_fp32(n) for n in base.tensors}
    # what every writer is fed: merged tensors in fp32, untouched ones as stored (upcast here, exactly)
    got = {n: t.to(torch.float32) for n, t in iter_merged(base, adapter)}
    assert list(got) == list(base.tensors), "every base tensor, in on-disk order"
    changed = 0
    for name, t in got.items():
        # fp32 against fp32: equal up to the order of float operations (~1e-6 relative)
        torch.testing.assert_close(
            t, want[name], rtol=1e-5, atol=1e-6, msg=f"{kind}: {name} differs from PEFT's merge"
        )
        changed += int(not torch.equal(t, base_sd[name]))
    assert changed >= 3, "the adapter must actually change weights, or this test proves nothing"


@pytest.mark.parametrize("base_name", ["llama-bpe", "llama-bpe-nf4"])
def test_merged_dir_logits_equal_in_memory_peft_model_within_bf16_rounding(
    export_models, tmp_path, base_name
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = BaseModel(export_models / base_name, base_name)
    adapter = open_adapter(export_models / f"{base_name}-lora", "lora")
    write_merged_dir(tmp_path / "out", base, adapter, base.path, dtype="bfloat16")
    ids = torch.tensor([[5, 17, 99, 250, 3, 411, 77, 12, 600, 42, 8, 301]])
    peft_model = PeftModel.from_pretrained(fp32_model_from_dir(base.path), adapter.path).eval()
    with torch.no_grad():
        ref = peft_model(ids).logits
        torch_bf16 = peft_model.to(torch.bfloat16)(ids).logits.float()  # torch's own bf16 path
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)(ids).logits
    merged_err = (merged - ref).abs().max().item()
    bf16_err = (torch_bf16 - ref).abs().max().item()
    assert 0 < merged_err <= 2 * bf16_err, (
        f"merged-dir logits differ from the PEFT model by {merged_err:.3g}; bf16 rounding alone (torch's "
        f"bf16 path) gives {bf16_err:.3g}; the merge may add at most twice that"
    )


def test_an_adapter_with_non_finite_values_is_refused_before_the_merge_and_writes_nothing(
    export_models, store, tmp_path
):
    # before the non-finite check of the adapter itself (issue 30), the merge refused the result (CorruptInput)
    from safetensors.torch import load_file, save_file

    root = tmp_path / "models"
    copy_tree(export_models / "llama-bpe", root / "llama-bpe")
    bad = copy_tree(export_models / "llama-bpe-lora", root / "bad-lora")
    tensors = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key][3, 2] = float("inf")
    save_file(tensors, bad / "adapter_model.safetensors")
    req = ExportRequest(
        targets=[ExportTarget.gguf("F16"), ExportTarget.merged()],
        adapter_path="bad-lora",
        base_model_path="llama-bpe",
        verify=VerifyOptions(skip=True),
    )
    with pytest.raises(
        InvalidArgument, match=r"'bad-lora': .*layers\.1\.mlp\.up_proj\.lora_B\.weight holds 1 non-finite"
    ):
        run_export(req, model_root=root, store=store)
    assert store_is_empty(store), "a failed export must leave no artifact and no scratch files"


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch, bitsandbytes  # noqa: F401  (imports before the baseline)
    from strop.export_svc.core.hf_dir import write_merged_dir
    from strop.export_svc.core.base_source import BaseModel
    from strop.export_svc.core.adapter_source import open_adapter

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    base = BaseModel(Path(sys.argv[1]), "big")
    adapter = open_adapter(Path(sys.argv[2]), "lora")
    shard = int(sys.argv[4])
    # warm the code paths on one adapted tensor so lazy imports, the BLAS thread pool and its
    # workspaces (a fixed cost, not one that grows with the model) are in the baseline
    from strop.export_svc.core.merge import iter_merged
    list(iter_merged(base, adapter, names=[next(iter(adapter.modules))]))
    baseline = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    write_merged_dir(Path(sys.argv[3]), base, adapter, base.path, dtype="bfloat16", max_shard_bytes=shard)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM:")}))
    """
)


def test_peak_memory_of_a_sharded_merge_stays_near_one_shard_not_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from strop.fixtures import TinyShape, make_tiny_model

    shape = TinyShape(hidden_size=512, intermediate_size=1536, num_layers=16, num_heads=8, num_kv_heads=4)
    src = make_tiny_model(tmp_path / "src", arch="llama", shape=shape, seed=5)
    shard = 32 << 20
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "big", max_shard_size=shard)
    for f in src.glob("tokenizer*"):
        (tmp_path / "big" / f.name).write_bytes(f.read_bytes())
    make_random_adapter(tmp_path / "big", tmp_path / "lora", r=16)
    del model
    base = BaseModel(tmp_path / "big", "big")
    n_shards = len(base.files)
    model_bytes = base.nbytes_16bit
    assert n_shards >= 4, "the fixture must have several shards for this test to mean anything"
    largest_fp32 = max(math.prod(t.shape) * 4 for t in base.tensors.values() if "embed" not in t.name)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _RSS_SCRIPT,
            str(tmp_path / "big"),
            str(tmp_path / "lora"),
            str(tmp_path / "out"),
            str(shard),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    growth = r["peak"] - r["baseline"]
    written = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert written >= model_bytes
    # Merging the whole model in memory would hold at least the model (100 MiB bf16, twice that in
    # fp32). Streaming holds one adapted tensor's working set (source, fp32 weight, fp32 delta, cast
    # copy, BLAS buffers: a few times the largest fp32 projection, 1536x512 = 3 MiB), so the
    # resident set grows by less than one 32 MiB shard and by a quarter of the model at most.
    msg = f"peak RSS grew by {growth / 2**20:.1f} MiB"
    assert growth < shard, f"{msg}; one shard is {shard / 2**20:.0f} MiB"
    assert growth < 8 * largest_fp32, (
        f"{msg}; the largest projection is {largest_fp32 / 2**20:.1f} MiB in fp32"
    )
    assert growth < 0.25 * model_bytes, f"{msg} for a {model_bytes / 2**20:.0f} MiB model"
