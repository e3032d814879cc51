"""Datasets: SQuAD-format readers and writers, the offline synthetic generator,
tokenization into model windows, answer postprocessing and the official metrics.

Submodules are imported on demand so that ``import bertqa_bench.tasks.squad`` stays cheap.
"""
