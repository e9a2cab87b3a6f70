"""strop's trainer service: LoRA/QLoRA SFT and DPO jobs over gRPC (core in ``strop.trainer_svc.core``)."""
