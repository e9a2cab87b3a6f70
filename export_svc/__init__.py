"""strop's export service: merges LoRA adapters and writes vLLM, PEFT and GGUF outputs, each verified.

``core/`` holds the logic without gRPC; ``service.py`` (servicer: protobuf ⇄ the API dataclasses through
``strop.common.serde``) and ``server.py`` (process entry point) are the thin gRPC layer.
"""
