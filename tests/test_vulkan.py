"""The llama.cpp backend on a Vulkan device (in CI: Mesa's software lavapipe, selected by GGML_VK_VISIBLE_DEVICES=0).

Skipped unless the installed llama-cpp-python was built with -DGGML_VULKAN=on and ggml found a Vulkan device.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from conftest import assert_speculated  # noqa: E402

import tandem  # noqa: E402
from tandem.backends.devices import device_info, list_devices, no_device_hint  # noqa: E402

VULKAN = device_info("vulkan")
pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(VULKAN is None, reason=f"no Vulkan device: {no_device_hint('vulkan')}"),
]

IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 30, 201, 77, 8, 150, 23]
PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 64, 128, 11, 30, 201]]


def load(path: str, device: str = "vulkan", **kw):
    return tandem.load(path, backend="llama.cpp", device=device, n_ctx=128, n_threads=1, **kw)


def generate(target, prompt, draft=None, max_tokens=16):
    return tandem.generate(target, prompt=prompt, draft=draft, max_tokens=max_tokens, draft_policy="fixed",
                           draft_max=4)


def test_list_devices_names_the_vulkan_device_and_its_memory_kind():
    assert VULKAN in list_devices()
    assert VULKAN.backend == "vulkan" and VULKAN.name.startswith("Vulkan") and VULKAN.description
    assert VULKAN.is_gpu  # what llama.cpp offloads layers to
    assert VULKAN.memory_total_bytes > 0
    if VULKAN.vulkan_device_type == "cpu":  # lavapipe, SwiftShader: buffers are plain host memory
        assert VULKAN.memory_kind == "host"
    elif VULKAN.vulkan_device_type == "integrated-gpu":
        assert VULKAN.memory_kind == "host-visible/unified"
    elif VULKAN.vulkan_device_type == "discrete-gpu":
        assert VULKAN.memory_kind == "device-local"
    assert VULKAN.memory_kind in VULKAN.summary()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
def test_tiny_model_runs_on_vulkan_like_on_cpu(tiny_model_path, qtype):
    path = tiny_model_path(qtype=qtype)
    on_vulkan, on_cpu = load(path), load(path, device="cpu")
    assert on_vulkan.device == "vulkan" and on_vulkan.n_gpu_layers == -1
    got, expected = on_vulkan.logits(IDS), on_cpu.logits(IDS)
    assert got.shape == expected.shape == (len(IDS), on_vulkan.vocab_size)
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 1e-2
    on_vulkan.close()
    on_cpu.close()


@pytest.mark.parametrize("draft_qtype", ["F32", "Q8_0"])
def test_greedy_speculative_equals_plain_on_vulkan(tiny_model_path, draft_qtype):
    target = load(tiny_model_path(qtype="F32", seed=0))
    draft = load(tiny_model_path(qtype=draft_qtype, seed=0))  # same weights: accepts most drafts
    stats = []
    for prompt in PROMPTS:
        plain = generate(target, prompt)
        spec = generate(target, prompt, draft=draft)
        assert spec.tokens == plain.tokens, prompt
        assert plain.stats.draft_tokens == 0
        stats.append(spec.stats)
    assert_speculated(*stats)
    draft.close()
    target.close()


def test_greedy_speculative_equals_plain_with_a_disagreeing_draft(tiny_model_path):
    target = load(tiny_model_path(qtype="F32", seed=0))
    draft = load(tiny_model_path(qtype="F32", seed=1))  # other random weights: most drafts are rejected
    stats = []
    for prompt in PROMPTS:
        spec = generate(target, prompt, draft=draft)
        assert spec.tokens == generate(target, prompt).tokens, prompt
        stats.append(spec.stats)
    assert_speculated(*stats, accepted=False, rejected=True)  # rejection is the point here
    draft.close()
    target.close()


@pytest.mark.real
def test_real_pair_greedy_speculative_equals_plain_on_vulkan(real_pair):
    target = tandem.load(real_pair[0], backend="llama.cpp", device="vulkan", n_ctx=512)
    draft = tandem.load(real_pair[1], backend="llama.cpp", device="vulkan", n_ctx=512)
    messages = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
    plain = tandem.generate(target, messages=messages, max_tokens=16)
    spec = tandem.generate(target, messages=messages, draft=draft, max_tokens=16, draft_policy="fixed", draft_max=4)
    assert spec.tokens == plain.tokens
    assert_speculated(spec.stats)
    draft.close()
    target.close()


def test_doctor_runs_on_vulkan_and_names_the_device(capsys, tiny_model_path):
    import json

    from tandem.cli import main

    args = ["doctor", "--json", "--repeats", "2", "--backend", "llama.cpp", "--device", "vulkan",
            "--model", tiny_model_path(qtype="Q8_0", seed=0), "--draft", tiny_model_path(qtype="Q4_0", seed=0)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("vulkan")
    assert report["draft_step_ms_standalone"] > 0 and report["paired_over_standalone"] > 0
    assert set(report["verify_ms"]) == {str(n) for n in range(1, 17)}
    assert VULKAN.memory_kind in json.dumps(report)  # the device and its memory kind are in the diagnosis
