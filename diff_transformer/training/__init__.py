"""Training: the loop (``trainer``), process groups and small collectives (``distributed``), checkpoints
(``checkpoint``, ``checkpoint_tools``), failure handling (``failures``), logging (``metrics``) and FLOP/memory
accounting (``accounting``). Imports ``models``, ``config``, ``compat``, ``fileio`` and ``data``; never
``analysis`` or ``launch``.
"""
