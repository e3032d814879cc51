"""Model transforms: what the PyTorch backend (torch_builder) does to a loaded model before it
runs it. FP8 GEMMs (``fp8_surgery`` swaps in ``fp8_modules``; ``fp8_rules`` holds the options'
vocabularies and their one check), dynamic INT8 GEMMs (``int8_dynamic``), the layers kept in 16
bits (``layer_sensitivity``) and the padding-free encoder (``packed_encoder``). The GPU kernels
they call are in bertqa_bench/kernels/."""
