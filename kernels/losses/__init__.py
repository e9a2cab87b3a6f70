"""Chunked losses over final hidden states that never materialise full logits: one engine (``logps.py``), one
small file per loss (``dpo.py``, ``orpo.py``, ``cpo.py`` for CPO/SimPO, ``kto.py``, what they share in
``preference.py``; ``rl.py``, ``grpo.py``, ``kl.py``); the SFT loss is the fused linear cross-entropy op."""

from .cpo import CPO_LOSS_TYPES, CPOLossOutput, cpo_loss_from_logps, strop_cpo_loss
from .dpo import LOSS_TYPES, DPOLossOutput, dpo_loss_from_logps, strop_dpo_loss
from .kto import KTO_LOSS_TYPES, KTOLossOutput, kto_loss_from_logps, strop_kto_loss
from .logps import sequence_logps
from .orpo import ORPOLossOutput, orpo_loss_from_logps, strop_orpo_loss

__all__ = [
    "CPO_LOSS_TYPES",
    "KTO_LOSS_TYPES",
    "LOSS_TYPES",
    "CPOLossOutput",
    "DPOLossOutput",
    "KTOLossOutput",
    "ORPOLossOutput",
    "cpo_loss_from_logps",
    "dpo_loss_from_logps",
    "kto_loss_from_logps",
    "orpo_loss_from_logps",
    "sequence_logps",
    "strop_cpo_loss",
    "strop_dpo_loss",
    "strop_kto_loss",
    "strop_orpo_loss",
]
