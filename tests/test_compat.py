"""The megatron-core workarounds: every site they patch still exists in the installed release, and another release
is refused before a patch is applied."""

import subprocess
import sys
from pathlib import Path

import pytest

from diff_transformer import compat

REPO = Path(__file__).resolve().parent.parent


def test_every_patched_site_exists_in_the_installed_megatron_core():
    """In a fresh interpreter: the sites as megatron-core ships them, before this process's patches replace them."""
    code = "from diff_transformer import compat; print(compat.installed_megatron_core_version()); " \
           "print(compat.patch_site_problems())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == [compat.MEGATRON_CORE_VERSION, "[]"]


def test_a_moved_site_is_reported():
    site = compat.PatchSite("example", "megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                            "a line that is not there")
    assert "no longer contains 'a line that is not there'" in site.problem()
    missing = compat.PatchSite("example", "megatron.core.optimizer.clip_grads", "renamed_function")
    assert "has no renamed_function" in missing.problem()


def test_another_megatron_core_release_is_refused(monkeypatch):
    monkeypatch.setattr(compat, "installed_megatron_core_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 is installed.*megatron-core==0\.16\.1"):
        compat.check_megatron_core_version()
