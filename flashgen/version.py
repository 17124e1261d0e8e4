"""The package version, in a module of its own so that flashgen's modules read it without
importing the package ``__init__`` (whose lazy loaders import them)."""

__version__ = "0.1.0"
