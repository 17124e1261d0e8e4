"""The build stage: render plans to CUDA (render), compile them with nvcc or NVRTC (compile), the
on-disk kernel cache (cache) and generated/ (generate)."""
