"""Natural Questions scoring restated from its definitions, for the tests that check the suite's
NQ metric against a reference.

The long/short rules are those of the official evaluator (google-research-datasets/
natural-questions, nq_eval.py + eval_utils.py): ``score_long_answer``, ``score_short_answer``,
``gold_has_*_answer`` with --long/short_non_null_threshold, and the F1-optimal threshold of
``compute_pr_curves``/``compute_final_f1``. Micro-F1 is Kaggle's TF2-QA count at those
thresholds. Nothing here imports ``bertqa_bench``: it reads the raw jsonl records and the raw
prediction dicts itself, so a bug in the suite's reader, metric or task wiring can't hide in it.

Where the official script needs a prediction for every gold example, an example without one is
scored as a null prediction (what the suite documents).
"""
import gzip
import json
from collections import OrderedDict


def read_jsonl(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _null(span):
    return span["start_token"] < 0 and span["end_token"] < 0


def _span_list(spans):
    """The non-null spans of a list, as a set of (start, end)."""
    return {(s["start_token"], s["end_token"]) for s in spans if not _null(s)}


def _yes_no(value):
    return str(value or "NONE").lower()


def gold_has_long_answer(annotations, threshold):
    return sum(not _null(a["long_answer"]) for a in annotations) >= threshold


def gold_has_short_answer(annotations, threshold):
    return sum(bool(_span_list(a["short_answers"])) or _yes_no(a["yes_no_answer"]) != "none"
               for a in annotations) >= threshold


def score_long_answer(annotations, pred, threshold):
    gold_has_answer = gold_has_long_answer(annotations, threshold)
    pred_has_answer = pred is not None and not _null(pred["long_answer"])
    is_correct = False
    score = pred["long_answer_score"] if pred is not None else float("-inf")
    if gold_has_answer and pred_has_answer:
        for a in annotations:
            if _null(a["long_answer"]):
                continue
            if (a["long_answer"]["start_token"], a["long_answer"]["end_token"]) == \
                    (pred["long_answer"]["start_token"], pred["long_answer"]["end_token"]):
                is_correct = True
                break
    return gold_has_answer, pred_has_answer, is_correct, score


def score_short_answer(annotations, pred, threshold):
    gold_has_answer = gold_has_short_answer(annotations, threshold)
    pred_has_answer = pred is not None and (bool(_span_list(pred["short_answers"]))
                                            or _yes_no(pred["yes_no_answer"]) != "none")
    is_correct = False
    score = pred["short_answers_score"] if pred is not None else float("-inf")
    if gold_has_answer and pred_has_answer:
        if _yes_no(pred["yes_no_answer"]) != "none":
            is_correct = any(_yes_no(pred["yes_no_answer"]) == _yes_no(a["yes_no_answer"]) for a in annotations)
        else:
            is_correct = any(_span_list(a["short_answers"]) and _span_list(a["short_answers"])
                             == _span_list(pred["short_answers"]) for a in annotations)
    return gold_has_answer, pred_has_answer, is_correct, score


def _divide(x, y):
    return x / y if y else 0.0


def best_f1(answer_stats):
    """compute_pr_curves + compute_final_f1: the best F1 over thresholds at each distinct score
    (stats sorted by score, highest first; a tie group counts at once) -> (f1, p, r, threshold)."""
    answer_stats = sorted(answer_stats, key=lambda x: x[-1], reverse=True)
    total_has_gold = sum(s[0] for s in answer_stats)
    total_correct = total_has_pred = 0
    scores_to_stats = OrderedDict()
    for has_gold, has_pred, is_correct, score in answer_stats:
        total_correct += is_correct
        total_has_pred += has_pred
        scores_to_stats[score] = [_divide(total_correct, total_has_pred), _divide(total_correct, total_has_gold)]
    best = (0.0, 0.0, 0.0, None)
    for threshold, (p, r) in scores_to_stats.items():
        f1 = _divide(2.0 * p * r, p + r)
        if f1 > best[0]:
            best = (f1, p, r, threshold)
    return best


def nq_scores(gold_records, predictions, *, long_non_null_threshold=2, short_non_null_threshold=2):
    """Percent long/short P/R/F1 and micro P/R/F1 of ``predictions`` (a list of official-format
    prediction dicts) against raw gold jsonl records."""
    by_id = {str(p["example_id"]): p for p in predictions}
    long_stats, short_stats = [], []
    for rec in gold_records:
        pred = by_id.get(str(rec["example_id"]))
        long_stats.append(score_long_answer(rec["annotations"], pred, long_non_null_threshold))
        short_stats.append(score_short_answer(rec["annotations"], pred, short_non_null_threshold))
    out = {}
    tp = fp = fn = 0
    for name, stats in (("long", long_stats), ("short", short_stats)):
        f1, p, r, thr = best_f1(stats)
        out.update({f"{name}_f1": 100 * f1, f"{name}_precision": 100 * p, f"{name}_recall": 100 * r})
        for has_gold, has_pred, is_correct, score in stats:
            # at the chosen threshold; with no F1 > 0 anywhere every prediction counts as null
            answered = has_pred and thr is not None and score >= thr
            if answered and is_correct:
                tp += 1
            elif answered:
                fp += 1
            elif has_gold:
                fn += 1
    mp, mr = _divide(tp, tp + fp), _divide(tp, tp + fn)
    out.update(micro_precision=100 * mp, micro_recall=100 * mr, micro_f1=100 * _divide(2 * mp * mr, mp + mr))
    return out
