"""The ``strop`` command line (``strop.cli.main:main``): a composition root over the SDK and, lazily, the services."""
