"""GPU kernels written in CUDA C, compiled at run time by NVRTC (``runtime.py``)."""
