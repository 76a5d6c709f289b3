"""GPU kernels written in Triton. On a machine without a GPU they run under Triton's
interpreter (TRITON_INTERPRET=1, set before import), which is how CPU CI checks them."""
