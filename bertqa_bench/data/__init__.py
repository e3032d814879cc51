"""The data stage: reading an evaluation set into examples and turning them into the fixed-shape
token features (input ids, masks, offsets) that every backend is fed. Task-specific parsing lives
in ``bertqa_bench.tasks``; this package holds the task-independent plumbing around it."""
