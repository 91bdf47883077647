"""Plain-PyTorch stand-ins for the FlashAttention libraries (GPU only) on a CPU: ``tests/stand_ins/flash_attn``, a
package with flash-attn 2's entry points (``flash_attn``, ``flash_attn.flash_attn_interface``) and flash-attn-4's
(``flash_attn.cute``, with its sm_90 tile choices in ``flash_attn.cute.interface``), computed from the materialised
map (``_reference.py``). Tests import them through
``installed()``; ``benchmarks/gpu_run.sh --dry-run`` puts the directory on PYTHONPATH for its flash-attn-4
steps. On a GPU the libraries themselves run: the ``gpu`` tests in tests/test_attention.py."""

import contextlib
import importlib
import sys
from pathlib import Path

STAND_INS = Path(__file__).resolve().parent / "stand_ins"


def _loaded():
    return [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]


@contextlib.contextmanager
def installed():
    """Inside the block ``flash_attn`` and ``flash_attn.cute`` are the stand-ins; yields the list every call appends
    (library, entry, q, k, v shapes) to. Afterwards they are gone, and whatever was imported under those names before
    is back."""
    saved = {name: sys.modules.pop(name) for name in _loaded()}
    sys.path.insert(0, str(STAND_INS))
    importlib.invalidate_caches()
    try:
        reference = importlib.import_module("flash_attn._reference")
        for name in ("flash_attn.cute", "flash_attn.flash_attn_interface"):
            importlib.import_module(name)
        reference.CALLS.clear()
        reference.TILES.clear()
        reference.BACKWARD.clear()
        yield reference.CALLS
    finally:
        sys.path.remove(str(STAND_INS))
        importlib.invalidate_caches()
        for name in _loaded():
            del sys.modules[name]
        sys.modules.update(saved)
