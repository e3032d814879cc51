"""bertqa_bench: how much faster does each inference backend run a BERT QA model, and are the answers the same?"""

__version__ = "0.1.0"
