"""Chunked losses over final hidden states that never materialise full logits (DPO; ORPO, CPO/SimPO and KTO;
the SFT loss is the fused linear cross-entropy op)."""

from .dpo import LOSS_TYPES, DPOLossOutput, dpo_loss_from_logps, sequence_logps, strop_dpo_loss
from .preference import (
    CPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    CPOLossOutput,
    KTOLossOutput,
    ORPOLossOutput,
    cpo_loss_from_logps,
    kto_loss_from_logps,
    orpo_loss_from_logps,
    strop_cpo_loss,
    strop_kto_loss,
    strop_orpo_loss,
)

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
