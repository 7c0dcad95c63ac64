#!/usr/bin/env bash
# The git-ignored files lab/h200.sh and lab/h200_regime_session.sh carry to the GPU box, made on a fresh CPU
# machine after the README's install (.venv): a session's checkout starts without them.
#   .whs   gguf and diskcache wheels
#   .whp   llama_cpp_python's wheel without its libraries (the box's come from .cuda, setup's CUDA build or .vkx)
#   .xfer  llama-src.tar.xz (llama-cpp-python's vendored llama.cpp: setup compiles its CUDA build on the box) and
#          qwen-tokenizer.gguf (the real pair's tokenizer, for the random GGUFs regimewrite writes)
#   .gl    Debian's Vulkan loader and glvnd .debs (NVIDIA's Vulkan driver needs glvnd)
#   .vkx   llama-cpp-python built for Vulkan, as one xz tarball (VULKAN=0: not; ~8-20 min on 2 cores)
# and lists them in .git/info/exclude. Usage: bash lab/make_carries.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for d in .whl .whs .whp .xfer .old .cuda .vk .vkx .gl .vkserver; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p .whs .whp .xfer .gl .vkx

$py -m pip download -q --no-deps gguf diskcache -d .whs

$py -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
src=$tmp/llama_cpp_python-$version
cp -a "$src/vendor/llama.cpp" "$tmp/llama.cpp.src"
rm -rf "$tmp"/llama.cpp.src/{build*,docs,models,media}
tar -C "$tmp" -cf - llama.cpp.src | xz -T0 -6 > .xfer/llama-src.tar.xz

real=$($py -c "from tandem.loading import registry; print(registry.pull('qwen2.5-coder-1.5b-instruct', progress=False))")
$py -m tandem.synthetic.random_gguf .xfer/qwen-tokenizer.gguf --extract-tokenizer "$real"

(cd .gl && apt-get download libvulkan1 libglvnd0 libglx0 libgl1 libegl1 libopengl0 libgles2)

# .whp: the wheel pip built for the README's install (its cache), its libraries and their RECORD lines dropped
wheel=$(find ~/.cache/pip/wheels -name "llama_cpp_python-$version-*.whl" | head -1)
[ -n "$wheel" ] || { echo "no llama_cpp_python $version wheel in pip's cache: install as the README says first"; exit 1; }
mkdir "$tmp/whp" && (cd "$tmp/whp" && $py -m zipfile -e "$wheel" . && rm -rf include lib llama_cpp/lib &&
    grep -v -E "^(include|lib)/|^llama_cpp/lib/" "llama_cpp_python-$version.dist-info/RECORD" > R &&
    mv R "llama_cpp_python-$version.dist-info/RECORD")
rm -f .whp/*.whl
(cd "$tmp/whp" && $py -m zipfile -c "$OLDPWD/.whp/$(basename "$wheel")" llama_cpp "llama_cpp_python-$version.dist-info")

if [ "${VULKAN:-1}" = 1 ]; then  # as .ci/vulkan builds it; one copy of each library, under its soname
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libvulkan-dev glslc spirv-headers \
        g++ > /dev/null
    (cd "$src" && patch -s -p1 < "$OLDPWD/.ci/ggml-vulkan-old-headers.patch")
    CMAKE_ARGS="-DGGML_VULKAN=on -DGGML_NATIVE=off -DLLAVA_BUILD=off" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $py -m pip install -q --no-cache-dir --no-deps --target "$tmp/vk" "$src"
    lib=$tmp/vk/llama_cpp/lib
    for f in "$lib"/*.so.0.*; do
        base=${f%%.so.*}
        rm -f "$base.so" "$base.so.0" && mv "$f" "$base.so.0" && ln -s "$(basename "$base").so.0" "$base.so"
    done
    rm -f "$lib"/libllama-common* "$lib"/libmtmd*
    tar -C "$tmp/vk" -cf - llama_cpp | xz -T0 -6 > .vkx/llama_cpp.tar.xz
fi
du -sh .whs .whp .xfer .gl .vkx
