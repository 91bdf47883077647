"""Reading finished (or running) training runs and making sense of them: run loading, scaling-law fits, plots.

Works from run directories and W&B alone: imports nothing from ``diff_transformer.training`` or
``diff_transformer.models``, so it runs anywhere the runs' files are.
"""
