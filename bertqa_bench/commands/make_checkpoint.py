"""``python -m bertqa_bench.commands.make_checkpoint FAMILY OUT_DIR``: an extractive-QA checkpoint
folder of any encoder family, made offline (model/families.py says how), for ``bench --model``
or as the starting point of a fine-tune. The corpus of a suite's training file can train the
tokenizer, which is why this command sits above the suite loader."""
from __future__ import annotations

import argparse

from ..model import families
from ..suite import load_suite
from ..tasks import get_task


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertqa_bench.commands.make_checkpoint", description=families.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=families.FAMILY_NAMES)
    p.add_argument("out_dir")
    p.add_argument("--size", default="tiny", choices=("tiny", "base"))
    p.add_argument("--corpus", help="SQuAD-format file whose text trains a BPE/Unigram tokenizer")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grow-from", help="bert/distilbert: grow the encoder from this pretrained BERT-family encoder "
                                       "(e.g. embedded:all-MiniLM-L6-v2) instead of random weights")
    p.add_argument("--layers", type=int, help="encoder layers (default: the size's)")
    p.add_argument("--corpus-suite", help="train the tokenizer on this suite's training file (generated first)")
    a = p.parse_args(argv)
    corpus = a.corpus
    if a.corpus_suite:
        cfg = load_suite(a.corpus_suite)
        corpus = get_task(cfg.task.name).data_files(cfg.data, "train")[0]
    texts = families.corpus_from_squad(corpus) if corpus else None
    out = families.build_checkpoint(a.family, a.out_dir, texts=texts, size=a.size, seed=a.seed, vocab_size=a.vocab_size,
                                    grow_from=a.grow_from, layers=a.layers)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
