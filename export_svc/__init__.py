"""strop's export service: merges LoRA adapters and writes vLLM, PEFT and GGUF outputs, each verified.

``core/`` holds the logic without gRPC; ``service.py`` (servicer), ``convert.py`` (protobuf ⇄
dataclasses) and ``server.py`` (process entry point) are the thin gRPC layer.
"""
