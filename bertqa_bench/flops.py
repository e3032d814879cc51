"""Matrix FLOPs of a BERT QA forward pass, for achieved TFLOP/s beside each timing.

Counts 2 FLOPs per multiply-add of the matrix products (projections, FFN, attention scores
and context); element-wise work is ignored. BERT-base at 384 tokens gives ~70.7 GFLOP.
"""
from __future__ import annotations


def bert_flops_per_sequence(hidden: int, layers: int, intermediate: int, seq_len: int, heads_out: int = 2) -> float:
    s, h, i = seq_len, hidden, intermediate
    per_layer = 2 * s * (4 * h * h + 2 * h * i) + 2 * 2 * s * s * h
    return float(layers * per_layer + 2 * s * h * heads_out)


def qa_flops_per_sequence(config, seq_len: int) -> float:
    return bert_flops_per_sequence(config.hidden_size, config.num_hidden_layers, config.intermediate_size, seq_len)
