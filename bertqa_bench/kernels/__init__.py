"""GPU kernels, one a file, each with its launcher, its torch op (and fake) and its torch
reference beside it: Triton (``varlen_attention`` + ``_varlen_attention_triton``, ``gelu_fp8``),
cuBLASLt through nvmath-python (``cublaslt_epilogues``), cuDNN's FP8 attention
(``cudnn_fp8_attention``), a CuTe-DSL GEMM + GELU through quack (``quack_gemm_gelu``: measured by
the kernel bench, used by no row), and what they share (``fp8_math``, ``triton_support``).

This layer sits below ``backends``: it imports torch, Triton and the optional GPU libraries, and
nothing of the suite above it (backends, model, data), so a kernel can be tested and benchmarked
on its own (scripts/kernel_bench.py). How a file registers its op, and why, is written where it
does it:

* ``torch.library.triton_op`` (gelu_fp8.py): the op's body is one plain Triton launch, so
  Inductor traces into it and schedules the kernel itself; nothing has to run on the host.
* ``torch.library.custom_op`` + ``register_fake`` (varlen_attention.py, cublaslt_epilogues.py,
  cudnn_fp8_attention.py, quack_gemm_gelu.py): the body must run at call time, outside tracing: the attention's
  autotuner times configurations and its host-side checks read shapes; the cuBLASLt and cuDNN
  ops call libraries that plan (and cache) a kernel on the host. The fake gives torch.compile the
  output's shape and dtype without running any of that.
"""
