"""The measuring stage: running each backend variant (in its own worker process, or as DDP ranks)
over the evaluation features, timing it, and checking its answers against eager FP32. This covers
the benchmark driver (``bench``), its scheduling, sweeps, profiling, FLOP counting and the MLPerf
LoadGen scenarios."""
