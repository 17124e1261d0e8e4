"""The ``flashgen`` command line (:mod:`flashgen.cli.commands`)."""

from flashgen.cli.commands import main

__all__ = ["main"]
