"""OpenAI's fine-tuning API (``/v1/files``, ``/v1/fine_tuning/jobs``, ``/v1/models``; the ``openai`` SDK 3.60's wire)
over the trainer's jobs: ``strop serve openai``.

A composition root over the SDK (``strop.client``): a gRPC client of the trainer, no trainer internals. Responses are
built from the ``openai`` package's own types; docs/openai-gateway.md.
"""
