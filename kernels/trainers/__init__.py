"""Trainer glue: TRL's trainers on strop's chunked losses (the only room that reads TRL internals)."""

from .dpo import StropDPOMixin, add_hidden_states_head, remove_hidden_states_head, strop_dpo_trainer_class

__all__ = ["StropDPOMixin", "add_hidden_states_head", "remove_hidden_states_head", "strop_dpo_trainer_class"]
