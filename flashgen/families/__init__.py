"""Kernel families (planning: no torch, no CuPy)."""
