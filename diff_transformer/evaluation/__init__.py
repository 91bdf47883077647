"""Evaluation and attention analysis of checkpoints: loading a checkpoint for inference (``inference``), perplexity,
multi-needle retrieval, the attention analysis, their figures and reports. The command lines are
``python -m diff_transformer.evaluate`` and ``python -m diff_transformer.analyze``."""
