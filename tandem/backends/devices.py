"""The devices llama.cpp can run on in this process: name, kind, memory and whether that memory is the host's.

ggml (llama.cpp's tensor library) registers one backend per compiled-in API ("CPU", "Vulkan", "CUDA", "MTL", ...)
and each backend lists its devices. We read them through ggml's C API (`ggml_backend_dev_*`, not wrapped by
llama-cpp-python, so bound here with ctypes), which works with any build: a CPU-only wheel lists one CPU device.

Memory kind is what the doctor needs to explain a single-device pairing: with "device-local" memory the draft and
the target compete for VRAM bandwidth, with "host-visible/unified" (an iGPU, Apple silicon) or "host" (a CPU, or a
software Vulkan device such as Mesa's lavapipe/llvmpipe) they compete for the same DRAM bandwidth as the CPU.
ggml's own device type cannot tell lavapipe from a discrete GPU: its Vulkan backend reports every device that is not
`VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU` as GGML_BACKEND_DEVICE_TYPE_GPU, a CPU-type one included. So for Vulkan
devices we also ask the Vulkan loader for the physical device type (`vkGetPhysicalDeviceProperties`).

ggml's Vulkan backend skips CPU-type Vulkan devices unless they are named in GGML_VK_VISIBLE_DEVICES (comma
separated indices as `vulkaninfo --summary` numbers them), read once when the backend first starts: to use lavapipe,
run with GGML_VK_VISIBLE_DEVICES=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Literal

MemoryKind = Literal["device-local", "host-visible/unified", "host"]

# enum ggml_backend_dev_type. IGPU was inserted at 2 in 2025, moving ACCEL from 2 to 3; an older build's 2 is ACCEL.
_GGML_TYPE_CPU, _GGML_TYPE_GPU, _GGML_TYPE_IGPU, _GGML_TYPE_ACCEL, _GGML_TYPE_META = range(5)

# ggml backend registry names -> tandem's device kinds (the `device=` argument of tandem.load)
_BACKEND_KINDS = {"cpu": "cpu", "vulkan": "vulkan", "cuda": "cuda", "rocm": "rocm", "musa": "musa", "mtl": "metal",
                  "metal": "metal", "blas": "blas", "sycl": "sycl", "opencl": "opencl", "rpc": "rpc",
                  "cann": "cann", "webgpu": "webgpu", "zdnn": "zdnn"}
_DEVICE_ALIASES = {"hip": "rocm"}  # tandem device names that ggml calls otherwise
_HOST_BACKENDS = ("cpu", "blas", "zdnn")  # accelerators that compute on host memory beside the CPU backend

# VkPhysicalDeviceType
_VK_TYPE_NAMES = {0: "other", 1: "integrated-gpu", 2: "discrete-gpu", 3: "virtual-gpu", 4: "cpu"}
_VK_SUCCESS = 0
_VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
_VK_PROPERTIES_BYTES = 4096  # sizeof(VkPhysicalDeviceProperties) is 824 on x86-64; room to spare
_VK_DEVICE_TYPE_OFFSET = 16  # after apiVersion, driverVersion, vendorID, deviceID (uint32 each)
_VK_DEVICE_NAME_OFFSET = 20  # char deviceName[256]
_SOFTWARE_VULKAN_NAMES = ("llvmpipe", "lavapipe", "swiftshader")  # fallback when the loader cannot be asked


@dataclass(frozen=True)
class DeviceInfo:
    """One device as llama.cpp sees it."""

    name: str  # ggml's device name: "CPU", "Vulkan0", "CUDA0", "MTL0"
    description: str  # the hardware: "AMD Ryzen 7 ...", "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H200"
    backend: str  # tandem's device kind: "cpu" | "vulkan" | "cuda" | "metal" | "rocm" | "blas" | ...
    device_type: str  # ggml's: "cpu" | "gpu" | "igpu" | "accel" | "meta"
    memory_total_bytes: int  # what the backend reports: VRAM for a GPU, heap sizes for Vulkan, RAM for the CPU
    memory_free_bytes: int  # from the driver's budget where it has one (VK_EXT_memory_budget), else = total
    memory_kind: MemoryKind  # where the device's buffers live (see the module docstring)
    vulkan_device_type: str | None = None  # Vulkan devices only: "discrete-gpu" | "integrated-gpu" | "cpu" | ...

    @property
    def is_gpu(self) -> bool:
        """True for a device tandem's llama.cpp backend offloads layers to (device="vulkan"/"cuda"/"metal")."""
        return self.device_type in ("gpu", "igpu")

    def summary(self) -> str:
        """One line for the doctor, e.g. 'Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits), host memory, 23.5 GiB'."""
        return (
            f"{self.name}: {self.description}, {self.memory_kind} memory, "
            f"{self.memory_total_bytes / 2**30:.1f} GiB ({self.memory_free_bytes / 2**30:.1f} GiB free)"
        )


def list_devices() -> list[DeviceInfo]:
    """Every device of every backend compiled into the installed llama-cpp-python, in ggml's order.

    Returns [] when llama-cpp-python is not installed. A CPU-only build gives [the CPU device]; a Vulkan build on a
    machine with only lavapipe gives just the CPU too unless GGML_VK_VISIBLE_DEVICES selects it (module docstring).
    """
    ggml = _ggml_library()
    if ggml is None:
        return []
    vulkan_types = None  # asked once, only if there is a Vulkan device
    devices = []
    for index in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(index)
        backend_name = (ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev)) or b"").decode()
        backend = _BACKEND_KINDS.get(backend_name.lower(), backend_name.lower())
        device_type = _type_name(ggml.ggml_backend_dev_type(dev), backend)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        description = (ggml.ggml_backend_dev_description(dev) or b"").decode(errors="replace")
        vulkan_type = None
        if backend == "vulkan":
            if vulkan_types is None:
                vulkan_types = _vulkan_physical_device_types()
            vulkan_type = vulkan_types.get(description)
        devices.append(
            DeviceInfo(
                name=(ggml.ggml_backend_dev_name(dev) or b"").decode(),
                description=description,
                backend=backend,
                device_type=device_type,
                memory_total_bytes=total.value,
                memory_free_bytes=free.value,
                memory_kind=_memory_kind(backend, device_type, vulkan_type, description),
                vulkan_device_type=vulkan_type,
            )
        )
    return devices


def list_backends() -> list[str]:
    """Names of the ggml backends compiled in ("CPU", "Vulkan", ...), including those that found no device."""
    ggml = _ggml_library()
    if ggml is None:
        return []
    return [(ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)) or b"").decode()
            for i in range(ggml.ggml_backend_reg_count())]


def device_info(device: str = "cpu") -> DeviceInfo | None:
    """The device that tandem.load(..., backend="llama.cpp", device=device) computes on, or None if there is none.

    "cpu" is the CPU device; "vulkan", "cuda", "metal", ... the first GPU device of that backend ("vulkan:1" the
    second), which is where llama.cpp puts the layers when only one such device exists.
    """
    kind, _, ordinal = device.lower().partition(":")
    kind = _DEVICE_ALIASES.get(kind, kind)
    matches = [d for d in list_devices() if d.backend == kind and (kind == "cpu" or d.is_gpu)]
    index = int(ordinal) if ordinal else 0
    return matches[index] if index < len(matches) else None


def no_device_hint(device: str) -> str:
    """Why device (e.g. "vulkan") is missing and what to do, for error messages."""
    kind = device.split(":")[0].lower()
    backends = [b.lower() for b in list_backends()]
    if kind == "vulkan" and "vulkan" in backends:
        return ("this llama-cpp-python has the Vulkan backend but it found no GPU; a software device such as "
                "lavapipe is used only when selected: GGML_VK_VISIBLE_DEVICES=0 (its index in vulkaninfo --summary)")
    flag = {"vulkan": "GGML_VULKAN", "metal": "GGML_METAL", "cuda": "GGML_CUDA", "rocm": "GGML_HIP"}.get(kind)
    rebuild = f" (reinstall it with CMAKE_ARGS='-D{flag}=on', see docs/vulkan.md)" if flag else ""
    return f"the installed llama-cpp-python has the backends {list_backends()} and no {kind!r} device{rebuild}"


def _type_name(value: int, backend: str) -> str:
    if value == _GGML_TYPE_CPU:
        return "cpu"
    if value == _GGML_TYPE_GPU:
        return "gpu"
    if value == _GGML_TYPE_IGPU:  # or ACCEL in builds from before IGPU existed; those are host-side backends
        return "accel" if backend in _HOST_BACKENDS else "igpu"
    if value == _GGML_TYPE_ACCEL:
        return "accel"
    return "meta" if value == _GGML_TYPE_META else f"unknown({value})"


def _memory_kind(backend: str, device_type: str, vulkan_type: str | None, description: str) -> MemoryKind:
    if device_type in ("cpu", "accel"):
        return "host"
    if backend == "vulkan":
        if vulkan_type is None:  # the loader could not be asked: fall back on ggml's type and the driver's name
            if any(name in description.lower() for name in _SOFTWARE_VULKAN_NAMES):
                return "host"
            return "host-visible/unified" if device_type == "igpu" else "device-local"
        if vulkan_type == "cpu":
            return "host"
        return "host-visible/unified" if vulkan_type == "integrated-gpu" else "device-local"
    if device_type == "igpu" or backend == "metal":  # ggml-metal says "gpu", but Metal GPUs share host memory
        return "host-visible/unified"
    return "device-local"


_GGML_SIGNATURES = {
    "ggml_backend_dev_count": ([], ctypes.c_size_t),
    "ggml_backend_dev_get": ([ctypes.c_size_t], ctypes.c_void_p),
    "ggml_backend_dev_name": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_dev_description": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_dev_memory": (
        [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None),
    "ggml_backend_dev_type": ([ctypes.c_void_p], ctypes.c_int),
    "ggml_backend_dev_backend_reg": ([ctypes.c_void_p], ctypes.c_void_p),
    "ggml_backend_reg_name": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_reg_count": ([], ctypes.c_size_t),
    "ggml_backend_reg_get": ([ctypes.c_size_t], ctypes.c_void_p),
}
_ggml_cache: list[ctypes.CDLL | None] = []  # [the bound libggml] once looked up


def _ggml_library() -> ctypes.CDLL | None:
    """libggml as loaded by llama-cpp-python, with the registry functions typed; None if llama_cpp is missing."""
    if _ggml_cache:
        return _ggml_cache[0]
    try:
        import llama_cpp.llama_cpp as llc
    except ImportError:
        _ggml_cache.append(None)
        return None
    from tandem.backends.llamacpp_runtime import init_llama

    init_llama()  # route ggml's log through the backend's filter before a backend starts and prints its banner
    # libllama's handle, not llama_cpp._ggml's: with LLAMA_CPP_LIB_PATH set, only the former is the libggml that
    # llama.cpp itself runs on. dlsym on it also searches its dependencies libggml and libggml-base.
    lib = llc._lib
    for name, (argtypes, restype) in _GGML_SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    _ggml_cache.append(lib)
    return lib


def _vulkan_physical_device_types() -> dict[str, str]:
    """deviceName -> VkPhysicalDeviceType name for every Vulkan device the loader lists; {} if it cannot be asked."""
    path = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    try:
        vk = ctypes.CDLL(path)
    except OSError:
        return {}

    class InstanceCreateInfo(ctypes.Structure):  # VkInstanceCreateInfo: no layers, no extensions
        _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                    ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                    ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                    ("ppEnabledExtensionNames", ctypes.c_void_p)]

    vk.vkCreateInstance.argtypes = [
        ctypes.POINTER(InstanceCreateInfo), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    ]
    vk.vkCreateInstance.restype = ctypes.c_int
    vk.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]
    vk.vkEnumeratePhysicalDevices.restype = ctypes.c_int
    vk.vkGetPhysicalDeviceProperties.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    vk.vkGetPhysicalDeviceProperties.restype = None
    vk.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    vk.vkDestroyInstance.restype = None

    info = InstanceCreateInfo(sType=_VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != _VK_SUCCESS:
        return {}
    try:
        count = ctypes.c_uint32(0)
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != _VK_SUCCESS:
            return {}
        handles = (ctypes.c_void_p * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles) != _VK_SUCCESS:
            return {}
        types = {}
        properties = ctypes.create_string_buffer(_VK_PROPERTIES_BYTES)  # VkPhysicalDeviceProperties
        for handle in handles[: count.value]:
            vk.vkGetPhysicalDeviceProperties(handle, properties)
            device_type = int.from_bytes(properties.raw[_VK_DEVICE_TYPE_OFFSET:_VK_DEVICE_NAME_OFFSET], "little")
            name = properties.raw[_VK_DEVICE_NAME_OFFSET:_VK_DEVICE_NAME_OFFSET + 256].split(b"\0", 1)[0]
            types[name.decode(errors="replace")] = _VK_TYPE_NAMES.get(device_type, "other")
        return types
    finally:
        vk.vkDestroyInstance(instance, None)
