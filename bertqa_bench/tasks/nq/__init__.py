"""Natural Questions (simplified format): reader, featurizer, BERT-joint model, postprocessing, metric.

Module map: ``reader`` (jsonl/.gz -> NQExample), ``features`` (context + windows),
``model`` (BertJointForNaturalQuestions), ``postprocess`` (logits -> official predictions),
``metrics`` (official NQ P/R/F1 + Kaggle micro-F1), ``synthetic`` (offline generator),
``task`` (NQTask, the runner's entry point).
"""
