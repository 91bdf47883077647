"""The megatron-core workarounds: every site they patch still exists in the installed release, and another release
is refused before a patch is applied."""

import pytest

from diff_transformer import compat


def test_every_patched_site_exists_in_the_installed_megatron_core():
    assert compat.installed_megatron_core_version() == compat.MEGATRON_CORE_VERSION
    assert compat.patch_site_problems() == []


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
