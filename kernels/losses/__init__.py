"""Chunked losses over final hidden states that never materialise full logits (DPO; the SFT loss is the
fused linear cross-entropy op)."""

from .dpo import LOSS_TYPES, DPOLossOutput, dpo_loss_from_logps, sequence_logps, strop_dpo_loss

__all__ = ["LOSS_TYPES", "DPOLossOutput", "dpo_loss_from_logps", "sequence_logps", "strop_dpo_loss"]
