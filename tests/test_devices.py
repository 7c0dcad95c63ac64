"""tandem.backends.devices on any llama-cpp-python build: the CPU device is always listed; memory kinds."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from tandem.backends import devices  # noqa: E402
from tandem.backends.devices import DeviceInfo, device_info, list_backends, list_devices  # noqa: E402

MEMORY_KINDS = ("device-local", "host-visible/unified", "host")


def test_cpu_device_is_listed_with_host_memory():
    cpus = [d for d in list_devices() if d.backend == "cpu"]
    assert len(cpus) == 1, list_devices()
    cpu = cpus[0]
    assert cpu.name == "CPU" and cpu.device_type == "cpu" and not cpu.is_gpu
    assert cpu.memory_kind == "host"
    assert cpu.memory_total_bytes > 2**27 and 0 < cpu.memory_free_bytes <= cpu.memory_total_bytes
    assert device_info("cpu") == cpu
    assert "CPU" in list_backends()


def test_every_device_is_well_formed():
    backends = {b.lower() for b in list_backends()}
    for device in list_devices():
        assert isinstance(device, DeviceInfo)
        assert device.name and device.backend
        assert device.memory_kind in MEMORY_KINDS, device
        assert device.device_type in ("cpu", "gpu", "igpu", "accel", "meta"), device
        assert device.backend in backends or device.backend == "metal", (device, backends)
        assert (device.vulkan_device_type is not None) <= (device.backend == "vulkan")
        summary = device.summary()
        assert device.name in summary and device.memory_kind in summary and "GiB" in summary


def test_absent_device_gives_none_and_a_hint():
    assert device_info("tpu") is None
    assert device_info("cpu:3") is None
    if device_info("cuda") is None:
        assert "GGML_CUDA" in devices.no_device_hint("cuda")


@pytest.mark.parametrize("backend, device_type, vulkan_type, description, kind", [
    ("cpu", "cpu", None, "AMD EPYC", "host"),
    ("blas", "accel", None, "OpenBLAS", "host"),
    ("vulkan", "gpu", "cpu", "llvmpipe (LLVM 15.0.6, 256 bits)", "host"),  # ggml calls lavapipe a "gpu"
    ("vulkan", "gpu", None, "llvmpipe (LLVM 15.0.6, 256 bits)", "host"),  # the loader could not be asked
    ("vulkan", "igpu", "integrated-gpu", "AMD Radeon 780M (RADV PHOENIX)", "host-visible/unified"),
    ("vulkan", "gpu", "discrete-gpu", "NVIDIA GeForce RTX 4090", "device-local"),
    ("cuda", "gpu", None, "NVIDIA H200", "device-local"),
    ("cuda", "igpu", None, "Orin", "host-visible/unified"),
    ("metal", "gpu", None, "Apple M3 Max", "host-visible/unified"),
])
def test_memory_kind(backend, device_type, vulkan_type, description, kind):
    assert devices._memory_kind(backend, device_type, vulkan_type, description) == kind


def test_device_type_names_across_ggml_versions():
    assert devices._type_name(0, "cpu") == "cpu"
    assert devices._type_name(1, "cuda") == "gpu"
    assert devices._type_name(2, "vulkan") == "igpu"
    assert devices._type_name(2, "blas") == "accel"  # ACCEL was 2 before IGPU was added
    assert devices._type_name(3, "blas") == "accel"
