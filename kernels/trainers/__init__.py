"""Trainer glue: TRL's trainers on strop's chunked losses (the only room that reads TRL internals)."""

from ._glue import unwrapped_model
from .dpo import StropDPOMixin, add_hidden_states_head, remove_hidden_states_head, strop_dpo_trainer_class
from .preference import (
    StropCPOMixin,
    StropKTOMixin,
    StropORPOMixin,
    strop_cpo_trainer_class,
    strop_kto_trainer_class,
    strop_orpo_trainer_class,
)
from .sft import StropSFTMixin, add_fused_logprob_head, remove_fused_logprob_head, strop_sft_trainer_class

__all__ = [
    "StropCPOMixin",
    "StropDPOMixin",
    "StropKTOMixin",
    "StropORPOMixin",
    "StropSFTMixin",
    "add_fused_logprob_head",
    "add_hidden_states_head",
    "remove_fused_logprob_head",
    "remove_hidden_states_head",
    "strop_cpo_trainer_class",
    "strop_dpo_trainer_class",
    "strop_kto_trainer_class",
    "strop_orpo_trainer_class",
    "strop_sft_trainer_class",
    "unwrapped_model",
]
