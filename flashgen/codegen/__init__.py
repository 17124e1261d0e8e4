"""Code generation shared by every kernel family: dtype records (:mod:`.dtypes`), DSL
expressions as CUDA (:mod:`.cuda_expr`), the kernel ABI (:mod:`.abi`) and the plan record
(:mod:`.plan`).  Pure Python: no torch, no CuPy, no kernel family."""
