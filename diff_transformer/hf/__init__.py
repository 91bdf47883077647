"""Hugging Face interchange: export a checkpoint as a transformers model directory, import a local Llama one.

``convert`` maps state dicts and configs (torch only); ``export`` and ``importer`` read and write checkpoints and
directories. ``transformers`` is imported only by ``export`` (and the tests), never by training code; ``importer``
needs ``safetensors`` alone. Command lines: ``python -m diff_transformer.export`` and
``python -m diff_transformer.import_hf``.
"""
