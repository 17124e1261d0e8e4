"""The op on CPU tensors: :mod:`.attention` (blocked attention and its backward, the CPU
implementation of every op form) and :mod:`.reference` (the float64 reference, the test
oracle).  Imports no other :mod:`flashgen.ops` module."""
