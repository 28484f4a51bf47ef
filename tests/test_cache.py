"""hf_bpd's cache directory (hf_bpd/disk_cache.py)."""

from hf_bpd import disk_cache as cache


def test_cache_root_respects_environment(monkeypatch, tmp_path):
    for var in ("HF_BPD_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "hf_bpd"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache.cache_root() == tmp_path / "hf" / "hf_bpd"
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path / "own"))
    assert cache.cache_root() == tmp_path / "own"
