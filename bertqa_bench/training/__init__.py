"""The training stage: fine-tuning a question-answering model for a suite (single process or
data-parallel under torchrun), producing the checkpoint that the measuring stage benchmarks."""
