"""The export core: plain Python, no gRPC.

- ``sources``: open and validate base model / adapter directories (safetensors only).
- ``merge``: the exact fp32 merge (pure ``merge_state_dict`` and streaming ``iter_merged``).
- ``hf_dir`` / ``peft_dir``: vLLM-ready merged directories and LoRA adapter directories, with the
  checks vLLM would make.
- ``gguf_out`` / ``quantize``: GGUF models and LoRA adapters for llama.cpp; K-quants via llama.cpp.
- ``verify``: load each output in its consumer and compare it with the merged fp32 model.
- ``pipeline``: one export end to end (``run_export``); ``jobs``: persistent export jobs and events.
"""
