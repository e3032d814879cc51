"""evaluate-v1.1.py's evaluate(), statement for statement (stderr dropped), for the tests that
check the suite's scorer against the official one. It uses the official script's normalization
and per-answer metrics, which the suite's metrics module reproduces and tests on their own."""
from bertqa_bench.tasks.squad.metrics import exact_match_score, f1_score


def official_evaluate(dataset, predictions) -> dict:
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    _ = "Unanswered question " + qa["id"] + " will receive score 0."  # fails where it does
                    continue
                ground_truths = list(map(lambda x: x["text"], qa["answers"]))
                prediction = predictions[qa["id"]]
                # metric_max_over_ground_truths: max over a list (empty gold answers raise)
                exact_match += max(exact_match_score(prediction, gt) for gt in ground_truths)
                f1 += max(f1_score(prediction, gt) for gt in ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}
