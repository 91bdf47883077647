"""Training: the loop (``trainer``), checkpoints (``checkpoint``, ``checkpoint_tools``), failure handling
(``failures``), logging (``metrics``) and FLOP/memory accounting (``accounting``). Imports ``models``, ``config``,
``compat``, ``distributed``, ``fileio`` and ``data``; never ``analysis`` or ``launch``.
"""
