"""Export benchmark: strop's exporter vs llama.cpp's own converter on a Llama-3.2-3B-shape model, on the CPU.

The model: hidden 3072, intermediate 8192, 28 layers, 24/8 heads (head dim 128), vocab 128256, tied
embeddings off, random bf16 weights (std 0.02), and a 128256-piece SentencePiece tokenizer built
programmatically through the SentencePiece model proto (a real one cannot be trained here), so
llama.cpp's ``convert_hf_to_gguf.py`` takes its SentencePiece path. Both systems export the same
merged directory:

- F16: strop ``run_export(GGUF F16)`` vs ``convert_hf_to_gguf.py --outtype f16``;
- Q4_K_M: strop ``run_export(GGUF Q4_K_M)`` (exact F32 GGUF, then llama.cpp's quantizer with
  ftype 15) vs ``convert_hf_to_gguf.py --outtype f16`` followed by ``llama_model_quantize(ftype 15)``.

Every measurement runs in its own process; wall time and peak RSS (``wait4``'s ``ru_maxrss``; for
the two-step llama.cpp Q4_K_M, the larger of its two processes) are recorded. Verification is off
for strop (the converter does not verify either). Outputs are deleted after each measurement.

Steps (each fits in one 10-minute device command)::

    python bench/export_bench.py converter --sdist llama_cpp_python-0.3.36.tar.gz --dest .carry/llama-convert
    python bench/export_bench.py prepare --model-dir bench/out/llama32-3b
    python bench/export_bench.py run --model-dir bench/out/llama32-3b --converter .carry/llama-convert \\
        --systems strop,llama.cpp --types F16,Q4_K_M --results bench/out/export_bench.json
    python bench/export_bench.py report --results bench/out/export_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_32_3B = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# the model


def _pieces(n_normal: int) -> list[str]:
    """``n_normal`` distinct word pieces: ▁a, ▁b, ..., ▁zz, ..., then the same without ▁."""
    import itertools
    import string

    out: list[str] = []
    for length in range(1, 6):
        for combo in itertools.product(string.ascii_lowercase, repeat=length):
            w = "".join(combo)
            out += ["▁" + w, w]
            if len(out) >= n_normal:
                return out[:n_normal]
    raise ValueError("too many pieces")


def build_spm_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A SentencePiece model (unigram, byte fallback) of exactly ``vocab_size`` pieces, plus tokenizer.json.

    Pieces: <unk> <s> </s>, <|im_start|> <|im_end|> (user-defined), 256 byte pieces, word pieces.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    m = pb.ModelProto()
    T = pb.ModelProto.SentencePiece
    specials = [
        ("<unk>", T.UNKNOWN),
        ("<s>", T.CONTROL),
        ("</s>", T.CONTROL),
        ("<|im_start|>", T.USER_DEFINED),
        ("<|im_end|>", T.USER_DEFINED),
    ]
    pieces = [(p, 0.0, t) for p, t in specials]
    pieces += [(f"<0x{b:02X}>", 0.0, T.BYTE) for b in range(256)]
    words = _pieces(vocab_size - len(pieces))
    pieces += [(w, -float(i + 1) / 100.0, T.NORMAL) for i, w in enumerate(words)]
    for p, score, t in pieces:
        sp = m.pieces.add()
        sp.piece, sp.score, sp.type = p, score, t
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.trainer_spec.vocab_size = vocab_size
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, 1, 2, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = True
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    (out_dir / "tokenizer.model").write_bytes(m.SerializeToString())

    tok = Tokenizer(models.Unigram([(p, s) for p, s, _ in pieces], unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
        ]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 131072,
            },
            indent=2,
        )
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def prepare(model_dir: Path, layers: int, seed: int = 0) -> None:
    """Write the random bf16 model (streamed tensor by tensor: never the whole model in memory)."""
    import torch

    from strop.common.archs import expected_tensors
    from strop.export_svc.core.st_io import PlannedTensor, ShardedSafetensorsWriter

    model_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "bfloat16",
        **LLAMA_32_3B,
        "num_hidden_layers": layers,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": LLAMA_32_3B["rope_theta"]},
    }
    config.pop("rope_theta")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    shapes = expected_tensors(config)
    plan = [PlannedTensor(n, torch.bfloat16, s) for n, s in sorted(shapes.items())]
    writer = ShardedSafetensorsWriter(model_dir, plan, 5 * 10**9)
    g = torch.Generator().manual_seed(seed)
    for t in plan:
        w = (
            torch.ones(t.shape)
            if t.name.endswith("norm.weight")
            else torch.randn(t.shape, generator=g) * 0.02
        )
        writer.write(t.name, w.to(torch.bfloat16))
    writer.finish()
    build_spm_tokenizer(model_dir, LLAMA_32_3B["vocab_size"])
    print(f"wrote {writer.bytes_total / 1e9:.2f} GB in {len(writer.shards)} shards to {model_dir}")


def extract_converter(sdist: Path, dest: Path) -> None:
    """Copy convert_hf_to_gguf.py, its conversion/ package and gguf-py/ out of the llama-cpp-python sdist."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        prefix = next(
            n for n in tar.getnames() if n.endswith("vendor/llama.cpp/convert_hf_to_gguf.py")
        ).rsplit("/", 1)[0]
        for member in tar.getmembers():
            rel = member.name[len(prefix) + 1 :] if member.name.startswith(prefix + "/") else None
            if (
                rel
                and (rel == "convert_hf_to_gguf.py" or rel.startswith(("conversion/", "gguf-py/")))
                and member.isfile()
            ):
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
    print(f"converter in {dest}")


# ---------------------------------------------------------------------------------------------
# measurements


def _measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one command run as a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def run_strop(model_dir: Path, work: Path, gguf_type: str) -> dict:
    out = work / "strop-artifacts"
    shutil.rmtree(out, ignore_errors=True)
    models = model_dir.parent
    wall, rss = _measure(
        [sys.executable, __file__, "worker-strop", str(models), model_dir.name, str(out), gguf_type]
    )
    files = list(out.glob("*/*.gguf"))
    size = sum(f.stat().st_size for f in files)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "system": "strop",
        "type": gguf_type,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": rss,
        "file_bytes": size,
    }


def run_llama_cpp(model_dir: Path, work: Path, converter: Path, gguf_type: str) -> dict:
    f16 = work / "llama-cpp-f16.gguf"
    convert = [
        sys.executable,
        str(converter / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        "f16",
        "--outfile",
        str(f16),
    ]
    wall, rss = _measure(convert)
    steps = {"convert_f16_s": round(wall, 1)}
    out = f16
    if gguf_type != "F16":
        out = work / f"llama-cpp-{gguf_type}.gguf"
        w2, r2 = _measure([sys.executable, __file__, "worker-quantize", str(f16), str(out), gguf_type])
        steps["quantize_s"] = round(w2, 1)
        wall, rss = wall + w2, max(rss, r2)
    size = out.stat().st_size
    for p in (f16, out):
        p.unlink(missing_ok=True)
    return {
        "system": "llama.cpp",
        "type": gguf_type,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": rss,
        "file_bytes": size,
        **steps,
    }


def worker_strop(models: str, model_name: str, artifacts: str, gguf_type: str) -> None:
    from strop.common.artifacts import ArtifactStore
    from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
    from strop.export_svc.core.pipeline import run_export

    req = ExportRequest(
        base_model_path=model_name, targets=[ExportTarget.gguf(gguf_type)], verify=VerifyOptions(skip=True)
    )
    run_export(req, model_root=Path(models), store=ArtifactStore(artifacts))


def worker_quantize(src: str, dst: str, gguf_type: str) -> None:
    from strop.export_svc.core.quantize import quantize_gguf

    quantize_gguf(Path(src), Path(dst), gguf_type)


def report(results: list[dict]) -> str:
    lines = [
        "| system | type | wall (s) | peak RSS (GiB) | file (GB) | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        notes = ", ".join(f"{k} {v}" for k, v in r.items() if k.endswith("_s") and k != "wall_s")
        lines.append(
            f"| {r['system']} | {r['type']} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"{r['file_bytes'] / 1e9:.2f} | {notes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("converter", help="extract llama.cpp's converter from the llama-cpp-python sdist")
    c.add_argument("--sdist", required=True)
    c.add_argument("--dest", default=".carry/llama-convert")
    c = sub.add_parser("prepare", help="write the random Llama-3.2-3B-shape model")
    c.add_argument("--model-dir", default="bench/out/llama32-3b")
    c.add_argument(
        "--layers", type=int, default=LLAMA_32_3B["num_hidden_layers"], help="fewer for a smoke test"
    )
    c = sub.add_parser("run", help="measure the systems; appends to --results")
    c.add_argument("--model-dir", default="bench/out/llama32-3b")
    c.add_argument("--converter", default=".carry/llama-convert")
    c.add_argument("--work", default="bench/out/work")
    c.add_argument("--systems", default="strop,llama.cpp")
    c.add_argument("--types", default="F16,Q4_K_M")
    c.add_argument("--results", default="bench/out/export_bench.json")
    c = sub.add_parser("report", help="print the Markdown table")
    c.add_argument("--results", default="bench/out/export_bench.json")
    w = sub.add_parser("worker-strop")
    w.add_argument("args", nargs=4)
    w = sub.add_parser("worker-quantize")
    w.add_argument("args", nargs=3)
    a = p.parse_args(argv)
    if a.cmd == "converter":
        extract_converter(Path(a.sdist), Path(a.dest))
    elif a.cmd == "prepare":
        prepare(Path(a.model_dir), a.layers)
    elif a.cmd == "worker-strop":
        worker_strop(*a.args)
    elif a.cmd == "worker-quantize":
        worker_quantize(*a.args)
    elif a.cmd == "run":
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        results_path = Path(a.results)
        results = json.loads(results_path.read_text())["results"] if results_path.is_file() else []
        for gguf_type in a.types.split(","):
            for system in a.systems.split(","):
                r = (
                    run_strop(Path(a.model_dir), work, gguf_type)
                    if system == "strop"
                    else run_llama_cpp(Path(a.model_dir), work, Path(a.converter), gguf_type)
                )
                r.update(cpus=os.cpu_count(), host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
                print(json.dumps(r), flush=True)
                results.append(r)
                results_path.parent.mkdir(parents=True, exist_ok=True)
                results_path.write_text(json.dumps({"model": str(a.model_dir), "results": results}, indent=2))
        print(report(results))
    else:
        print(report(json.loads(Path(a.results).read_text())["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
