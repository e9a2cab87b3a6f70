"""The export core: plain Python, no gRPC. Requests, targets and results are the export API's dataclasses
(``strop.common.export_types``); architectures come from ``strop.common.archs``.

- ``base_source`` / ``adapter_source``: open and validate the base model and the adapter directories
  (safetensors only); ``nf4_on_load``: how the trainer quantized a 16-bit base on load, to re-create its codes.
- ``merge``: the exact fp32 merge (``merge_weight``, streamed over a model by ``iter_merged``).
- ``hf_dir`` / ``peft_dir``: vLLM-ready merged directories and LoRA adapter directories, with the
  checks vLLM would make.
- ``gguf_out``: GGUF models and LoRA adapters for llama.cpp, from ``gguf_types`` (the type table),
  ``gguf_vocab`` (tokenizer metadata, built by ``strop.common.gguf_vocab``, whose ``gguf_pretok`` confirms the
  pre-tokenizer name with llama.cpp: the decision LoadModel reports too),
  ``gguf_arch`` (what llama.cpp expects of an architecture) and
  ``gguf_writer`` (the streaming writer); ``quantize``: K-quants via llama.cpp.
- ``verify``: load each output in its consumer and compare it with the merged fp32 model.
- ``resolve``: validate a request once (``validate``); ``pipeline``: write a validated export
  (``write_export``, or ``run_export`` for both); ``jobs``: persistent export jobs and events.
"""
