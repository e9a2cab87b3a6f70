"""The Tinker REST API (the ``tinker`` SDK 0.38's wire) over the trainer's step API: ``strop serve tinker``.

A composition root over the SDK (``strop.client``): a gRPC client of the trainer, no trainer internals. The wire
contract is the ``tinker`` package itself (its pydantic types and its protobuf module); docs/tinker-gateway.md.
"""
