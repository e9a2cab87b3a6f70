"""Does the export service's CPU re-creation of a session's NF4 weights give the codes the trainer made on CUDA?

The exporter merges an adapter into "the model as trained": for a 16-bit base quantized to NF4 when the trainer
loaded it, it re-creates the NF4 codes and absmax with bitsandbytes' CPU ``quantize_4bit`` from the stored
weights (export_svc/core/base_source.py). On the CPU tier that is checked bitwise against the trainer's own
``Linear4bit``; this script checks it where training really happens: the trainer's ``load_model`` on CUDA
(a random Llama of 8B layer shapes, 2 layers, bf16 on disk), each Linear4bit's codes, absmax and nested
statistics against the CPU re-creation from the same weights, and the fp32 dequantizations: with scales
re-computed on the CPU, and with the scales the trainer records (``models.write_nf4_stats``), which must give
the trained weights bit for bit. Prints a table; exits 1 on any code or recorded-scale difference.

    python3 bench/nf4_codes_check.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from bitsandbytes.nn import Linear4bit
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from strop.common.trainer_types import LoadModelRequest, Quantization
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer, save_tokenizer
    from strop.trainer_svc.core import model_loading

    root = Path(tempfile.mkdtemp())
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "m")
    save_tokenizer(make_bpe_tokenizer(), root / "m")
    stored = {}
    for f in (root / "m").glob("*.safetensors"):
        stored.update(load_file(f))
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="m", quantization=Quantization.NF4), model_root=root, device="cuda:0"
    )
    meta = model_loading.base_quant_metadata(loaded.model)
    rows, bad = [], 0
    for name, mod in loaded.model.named_modules():
        if not isinstance(mod, Linear4bit):
            continue
        w = mod.weight
        qs = w.quant_state
        src = stored[name + ".weight"].to(getattr(torch, meta["base_quant.quantized_from"]))
        packed, cpu_qs = quantize_4bit(
            src,
            blocksize=qs.blocksize,
            compress_statistics=qs.nested,
            quant_type=qs.quant_type,
            quant_storage=torch.uint8,
        )
        codes_diff = int((packed.flatten() != w.data.cpu().flatten()).sum())
        absmax_diff = int((cpu_qs.absmax != qs.absmax.cpu()).sum())
        nested_diff = int((cpu_qs.state2.absmax != qs.state2.absmax.cpu()).sum()) if qs.nested else 0
        import copy

        gpu_qs = copy.deepcopy(qs)
        gpu_qs.dtype = torch.float32
        gpu_deq = dequantize_4bit(w.data, gpu_qs).cpu()  # the trained weights, in fp32
        cpu_qs.dtype = torch.float32
        cpu_deq = dequantize_4bit(packed, cpu_qs).reshape(gpu_deq.shape)
        deq_max = float((gpu_deq - cpu_deq).abs().max())
        # the exporter's weights: codes re-created on the CPU, scales as the trainer recorded them
        cpu_qs.absmax = qs.absmax.cpu()
        if qs.nested:
            cpu_qs.offset, cpu_qs.state2.absmax = qs.offset.cpu(), qs.state2.absmax.cpu()
            cpu_qs.state2.code = qs.state2.code.cpu()
        exported = dequantize_4bit(packed, cpu_qs).reshape(gpu_deq.shape)
        recorded_max = float((gpu_deq - exported).abs().max())
        bad += codes_diff + int(not torch.equal(gpu_deq, exported))
        rows.append(
            (
                name,
                tuple(src.shape),
                codes_diff,
                packed.numel(),
                absmax_diff,
                nested_diff,
                deq_max,
                recorded_max,
            )
        )
    print(f"quantized from {meta['base_quant.quantized_from']} on CUDA; bitsandbytes CPU re-creation:")
    print(
        "| layer | shape | code bytes differing | of | absmax codes differing | nested absmax differing "
        "| max abs dw, re-computed scales | max abs dw, recorded scales |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.3g} | {r[7]:.3g} |")
    print(json.dumps({"layers": len(rows), "differing": bad, "metadata": meta}))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
