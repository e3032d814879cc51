"""The model stage: locating and validating a question-answering checkpoint, loading it as the
eager PyTorch module the backends start from, and building the initial checkpoints of other model
families (``families``) or of larger sizes grown from a smaller model (``grow``)."""
