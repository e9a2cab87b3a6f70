"""Options every ``strop`` command shares, accepted before or after its subcommand alike.

argparse copies a subcommand's defaults over what an outer parser parsed, so a shared option is declared with
``default=SUPPRESS`` at every level it may appear (the top level, the command group and each subcommand) and its
default is applied once, when the command reads it (:func:`target_of`).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_TRAINER = os.environ.get("STROP_TRAINER", "127.0.0.1:50051")
DEFAULT_EXPORT = os.environ.get("STROP_EXPORT", "127.0.0.1:50052")


def add_target(parser: argparse.ArgumentParser, service: str = "") -> None:
    """``--target HOST:PORT`` on ``parser`` (``service``: "trainer", "export", or "" for the top level)."""
    if service == "trainer":
        what = f"trainer service host:port (default {DEFAULT_TRAINER}, env STROP_TRAINER)"
    elif service == "export":
        what = f"export service host:port (default {DEFAULT_EXPORT}, env STROP_EXPORT)"
    else:
        what = "the service the command calls, host:port (default: the command's, see its --help)"
    parser.add_argument(
        "--target",
        default=argparse.SUPPRESS,
        metavar="HOST:PORT",
        help=f"{what}; before or after the subcommand alike",
    )


def target_of(args: argparse.Namespace, default: str) -> str:
    """The ``--target`` given anywhere on the command line, else ``default``."""
    return getattr(args, "target", None) or default
