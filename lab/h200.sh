#!/usr/bin/env bash
# The H200 session that produced bench/results/h200-2026-12-03b/: one phase per device call, in this order.
#   wheels    the carried wheels (.whl, .whs) into /tmp/site, as setup does first
#   setup     wheels (.whl, .whs), Vulkan loader (.gl debs), llama-cpp-python built for Vulkan here (.vk), and llama.cpp's
#             CUDA llama-server built in the background from llama-cpp-python's vendored tree (.xfer/llama-src.tar.xz)
#   (then one call per chunk: cat .xfer/pNNN >> /root/m/pair.bin, carrying only that chunk; made here with
#   cat T.gguf D.gguf | split -b 58M -d -a 3 - .xfer/p: a carry holds the whole tree too, 64 MiB in all)
#   kernels   the fused kernels' tests on the GPU (if they fail, later phases run with the kernels off); with
#             STEP=variants, graphed decode steps (random weights of the real shapes; CONTEXTS, STEP_SET: space-
#             separated gpu_step --set lists) and a profile (PROFILE_SPAN cache slots); with SWEEP=1
#             lab/gpu_kernels.py's launch configurations (SWEEP_ONLY=inputs or outputs for half of them)
#   pair      split the real pair out of /root/m/pair.bin, check SHA-256
#   torch     split the real pair, tandem bench (torch, bf16)
#   doctor    tandem doctor (torch, bf16)
#   vulkan    tandem bench and doctor on llama.cpp's Vulkan backend (NVIDIA's Vulkan driver)
#   llamacpp  llama.cpp's own llama-server (CUDA): plain and with the draft
#   hf        tandem plain beside Hugging Face transformers: eager plain and assisted, static-cache compiled plain
#   batching  the batched engine (bench/results/h200-2026-12-04f-batching): its kernels' tests, the packed step
#             against batch size, the logits kernel, N requests together against one after another (synthetic)
#   cudaworker llama.cpp's CUDA build beside torch's CUDA (issue 26): the crash in one process, recorded, then the
#             worker process (lab/gpu_llamacpp_worker.py) and tandem bench through it; needs setup with
#             CUDA_LIBS=1 (libllama and libggml-cuda built shared from .xfer/llama-src.tar.xz, ~10 min)
#   loadtest  issue 22's load test (bench/serve_load.py): tandem plain and adaptive at 1/4/16/64 clients (4x as many
#             requests, max_tokens 128) and a 10-turn conversation; needs pair. Then loadllama: llama-server (CUDA,
#             from setup) plain and with the draft, -np = clients, one table with loadtest's numbers (~5 min each)
#   regimewrite random-weight GGUFs of the report's regime in /root/m/big/ (tandem/synthetic/random_gguf.py, the real
#             Qwen tokenizer from /root/m/T.gguf, else from .xfer/qwen-tokenizer.gguf, made here with --extract-tokenizer):
#             a Qwen2.5-32B-shape target in MIX (Q4_0 ~18.6 GB, default; Q4_K_M ~19.9 GB; Q6_K ~26.9 GB: one big
#             target at a time on the 64 GiB disk, the other removed) and 1.5B- and 0.5B-shape Q4_0 drafts (~1 GB)
#   regime    lab/gpu_report_regime.py on the CUDA build through tandem's llama.cpp worker: V(n), the draft step
#             alone and paired, plain vs adaptive at synthetic acceptance 0.6 and 0.8, 1, 2, 4 requests (needs setup
#             with CUDA_LIBS=1, as cudaworker; MIX, DRAFT=1.5b|0.5b, ACCEPTANCE=0.8 or PARTS=costs for a shorter call)
#   regimevk  the same on the Vulkan build (/root/vk, NVIDIA's Vulkan driver), in process
#   vksetup   the Vulkan half of setup as a call of its own: .gl, .vk, and .vkserver (llama-server for Vulkan)
#   regimellama llama-server (the CUDA one setup builds; SERVER=path for another) on the same files, plain and
#             draft-simple, -np 1, 2, 4, added to regime's table (REGIME=vulkan: to regimevk's)
#   structured issue 23: decode tok/s with a json_schema constraint over tok/s without, plain and speculative, and
#             acceptance with and without it (bench/structured_throughput.py, real pair, torch, bf16; needs pair and
#             the llguidance wheel among .whl)
#   synthetic the 32B/1.5B random-weight pair: doctor and bench at synthetic acceptance 0.8 (or one of them:
#             synthdoctor, synthbench; as two device calls each fits the 10-minute limit, the second one compiling
#             from the first one's cache)
# Carried paths (.whl .gl .vk .vkserver .xfer/...) are listed in .git/info/exclude; lab/h200_regime_session.sh
# says how to make them, and runs issue 26's session.
set -u
phase=$1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tandem() { python3 -m tandem.cli "$@"; }
T=${T:-/root/m/T.gguf} D=${D:-/root/m/D.gguf}  # T=, D=: another pair (cudaworker on the regime's files)
# llama-server: setup's CUDA_LIBS=1 build makes it beside the shared libraries (one CUDA compile for both)
LLAMA_SERVER=/root/llama/llama.cpp.src/build/bin/llama-server
[ -x $LLAMA_SERVER ] || LLAMA_SERVER=/root/llama-libs/llama.cpp.src/build/bin/llama-server
if [ ! -x $LLAMA_SERVER ] && [ -x /root/llama/cuda-libs/llama-server ]; then  # a carried build (.cuda, see setup)
    LLAMA_SERVER=/root/llama/cuda-libs/llama-server
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/root/llama/cuda-libs
fi
[ -f /root/m/unfused ] && export TANDEM_FUSED_PROJECTIONS=0 && echo "fused projections OFF (their GPU test failed)"
[ -f /root/m/nosplit ] && export TANDEM_SPLIT_K=0 && echo "split-K output projections OFF (slower step)"
[ -f /root/m/nopdl ] && export TANDEM_PDL=0 && echo "programmatic dependent launch OFF (slower step)"
case $phase in
wheels|setup)
    # .whl: the big wheels (llama_cpp_python's CPU build, llguidance), .whs: the small ones (gguf, diskcache); a call
    # may carry one of them (64 MiB a call), a later call installs the other (phase wheels)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        $(ls .whl/*.whl .whp/*.whl .whs/*.whl 2>/dev/null)
    ;;&
setup)
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    mkdir -p /root/m /root/vk && { [ ! -d .vk ] || cp -a .vk/. /root/vk/; }  # vksetup unpacks .vkx
    if [ -f .xfer/llama-src.tar.xz ] && [ "${CUDA_LIBS:-0}" != 1 ]; then  # llamacpp phase: the build takes 10 cores
        mkdir -p /root/llama && tar xJf .xfer/llama-src.tar.xz -C /root/llama
        setsid nohup bash -c "cd /root/llama/llama.cpp.src && cmake -S . -B build -DGGML_CUDA=on \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=off -DCMAKE_BUILD_TYPE=Release && \
            cmake --build build --target llama-server -j 10; echo build-exit \$?" >/root/build.log 2>&1 </dev/null &
    fi
    if [ "${CUDA_LIBS:-0}" = 1 ] && ls .cuda/cuda-libs.tar.xz.* > /dev/null 2>&1; then
        # a build an earlier session brought back (h200_regime_session.sh P): libllama, libggml-cuda (sm_90) and
        # llama-server, for this box's CUDA 13 runtime; ~10 device-minutes of compiling saved
        mkdir -p /root/llama && cat .cuda/cuda-libs.tar.xz.* | xz -d | tar x -C /root/llama \
            && echo "build-exit 0 (carried in .cuda)" > /root/build-libs.log
    elif [ "${CUDA_LIBS:-0}" = 1 ] && [ -f .xfer/llama-src.tar.xz ]; then  # for the cudaworker phase
        mkdir -p /root/llama-libs /root/llama/cuda-libs && tar xJf .xfer/llama-src.tar.xz -C /root/llama-libs
        setsid nohup bash -c "cd /root/llama-libs/llama.cpp.src && cmake -S . -B build -DGGML_CUDA=on \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=off -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release && \
            nice -n 19 cmake --build build --target llama llama-server -j 12 && \
            find build -name '*.so*' -exec cp -a {} /root/llama/cuda-libs/ \; ; \
            echo build-exit \$?" >/root/build-libs.log 2>&1 </dev/null &
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ls /usr/local/nvidia/share/vulkan/icd.d/ /usr/share/vulkan/icd.d/ /etc/vulkan/icd.d/ 2>&1 | head
    ;;
vksetup)  # the Vulkan half of setup, as a call of its own (carry .vk .gl .vkserver: with .whl .xfer past 64 MiB)
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    mkdir -p /root/vk /root/vkserver
    # .vkx: .vk as one xz tarball (5 MB against 34), so that it fits one call's carry beside .cuda
    if [ -d .vk ]; then cp -a .vk/. /root/vk/; else xz -dc .vkx/llama_cpp.tar.xz | tar -C /root/vk -xf -; fi
    # llama-server built for Vulkan here (bench/results/h200-2026-12-05b-regime/README.md), on .vk's libraries
    if [ -d .vkserver ]; then
        cp -a .vkserver/. /root/vkserver/ && cp -a /root/vk/llama_cpp/lib/. /root/vkserver/
        ln -sf libllama.so /root/vkserver/libllama.so.0
    fi
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    [ -f $icd ] && export VK_DRIVER_FILES=$icd
    # No offload means no Vulkan driver was found (.gl lacking glvnd: see h200_regime_session.sh): stop here, before
    # a call's minutes go to a regime that would fail at its first load
    PYTHONPATH=/root/vk:$PYTHONPATH LLAMA_CPP_LIB_PATH=/root/vk/llama_cpp/lib python3 -c "import llama_cpp.llama_cpp \
as l; ok = l.llama_supports_gpu_offload(); print('vulkan offload', ok); raise SystemExit(0 if ok else 1)" \
        2>&1 | tail -2; [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    LD_LIBRARY_PATH=/root/vkserver /root/vkserver/llama-server --version 2>&1 | tail -2
    ;;
kernels)
    python3 -m pytest -q -p no:cacheprovider tests/test_fused_projections.py tests/test_decode_attention.py 2>&1 \
        | tail -15 | tee $OUT/kernel_tests.txt
    grep -q " passed" $OUT/kernel_tests.txt && ! grep -q failed $OUT/kernel_tests.txt || touch /root/m/unfused
    # SWEEP=1: lab/gpu_kernels.py's launch configurations (SWEEP_ONLY=inputs or outputs for half of them)
    [ "${SWEEP:-0}" = 1 ] && python3 lab/gpu_kernels.py --shapes qwen2.5-1.5b ${SWEEP_ONLY:+--only $SWEEP_ONLY} \
        2>&1 | grep --line-buffered -v Warn | tee $OUT/kernels_sweep.txt
    # STEP="variant,variant": time the step (lab/gpu_step.py) in these variants, e.g. with PDL (last field 1)
    # and without (0); later phases keep PDL only if it was faster. STEP_SET: other launch constants, a second run
    if [ -n "${STEP:-}" ]; then
        python3 lab/gpu_step.py --variants $STEP --contexts ${CONTEXTS:-700} --decode ${DECODE:-0} 2>&1 \
            | grep --line-buffered -v Warn | tee $OUT/step.txt
        for set in ${STEP_SET:-}; do  # space-separated --set lists, one run each
            python3 lab/gpu_step.py --variants $STEP --contexts ${CONTEXTS:-700} --set $set 2>&1 \
                | grep --line-buffered -v Warn | tee -a $OUT/step_set.txt
        done
        python3 - $OUT/step.txt <<'PY' || touch /root/m/nopdl
import re, sys
ms = {m[0]: float(m[1]) for m in re.findall(r":1:9:1:1:1:(\d) context= 700 .* n=9: ([\d.]+) ms", open(sys.argv[1]).read())}
print("step ms, without / with PDL:", ms)
sys.exit(0 if ms.get("1", 1e9) <= ms.get("0", 1e9) else 1)
PY
        python3 lab/gpu_profile.py qwen2.5-1.5b 9 1 ${PROFILE_SPAN:-256} > $OUT/profile_1.5b_9rows.txt 2>&1
    fi
    ;;
pair)
    cd /root/m && head -c 1117320768 pair.bin > T.gguf && tail -c 491400064 pair.bin > D.gguf && cd - >/dev/null
    sha256sum $T $D | tee $OUT/sha256.txt
    ;;
torch)
    tandem bench --model $T --draft $D --device cuda --max-tokens 128 --repeats 3 --configs plain,adaptive,ngram \
        --json $OUT/bench_real.json --plot $OUT/bench_real.png 2>&1 | grep --line-buffered -v Warn | tee $OUT/bench_real.txt
    ;;
doctor)
    tandem doctor --model $T --draft $D --device cuda --draft-max 3 --repeats 15 --json > $OUT/doctor_cuda.json \
        2>$OUT/doctor_cuda.err
    python3 -c "import json; d = json.load(open('$OUT/doctor_cuda.json')); print({k: d[k] for k in \
        ('paired_over_standalone', 'draft_step_ms_standalone', 'draft_step_ms_target_idle', 'draft_step_ms_paired', \
        'target_step_ms', 'best_draft_len', 'verdict')})"
    ;;
vulkan)
    export PYTHONPATH=/root/vk:$PYTHONPATH LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/root/vk
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    [ -f $icd ] && export VK_DRIVER_FILES=$icd
    # The paired draft step at k = 3: the verify of 4 tokens stays on llama.cpp's matrix-vector kernels here.
    tandem doctor --model $T --draft $D --backend llama.cpp --device vulkan --draft-max 3 --json \
        > $OUT/doctor_vulkan.json 2>$OUT/doctor_vulkan.err
    tandem bench --model $T --draft $D --backend llama.cpp --device vulkan --max-tokens 128 --repeats 5 \
        --configs plain,adaptive,ngram --json $OUT/bench_vulkan.json --plot $OUT/bench_vulkan.png 2>&1 \
        | grep --line-buffered -v -i warn | tee $OUT/bench_vulkan.txt
    python3 -c "import json; d = json.load(open('$OUT/doctor_vulkan.json')); print({k: d[k] for k in \
        ('device', 'paired_over_standalone', 'target_step_ms', 'draft_step_ms_standalone', 'verdict')})"
    ;;
llamacpp)
    tail -2 /root/build.log
    python3 -m tandem.bench.llamaserver --server /root/llama/llama.cpp.src/build/bin/llama-server --model $T \
        --draft $D --n-max 3,8 --ngl 99 --max-tokens 128 --json $OUT/llama_server_cuda.json 2>&1 | tail -20
    ;;
hf)
    # Two prompts: the static-cache peer compiles anew for each prompt length.
    tandem bench --model $T --draft $D --device cuda --max-tokens 128 --configs plain --peer hf --peer hf-static \
        --prompts code,summary \
        --json $OUT/bench_hf.json 2>&1 | grep --line-buffered -v Warn | tail -25
    ;;
batching)
    python3 -m pytest -q -p no:cacheprovider tests/test_batched_kernels.py tests/test_packed_forward.py 2>&1 \
        | tail -5 | tee $OUT/batched_tests.txt
    python3 lab/gpu_logits.py 2>&1 | grep -v Warn | tee $OUT/logits.txt
    # TANDEM_COMPILE=0: the packed path compiles nothing (the long-prompt step's 46 s compile is not needed here)
    TANDEM_COMPILE=0 python3 lab/gpu_batched_step.py --eager 4,16 2>&1 | grep -v Warn | tee $OUT/step.txt
    S=qwen2.5-1.5b,qwen2.5-0.5b
    TANDEM_COMPILE=0 python3 bench/batching.py --synthetic-shape $S --device cuda --dtype bfloat16 \
        --requests 1,4,16 --repeats 3 2>&1 | grep -v Warn | tee $OUT/batching.txt
    TANDEM_COMPILE=0 python3 bench/batching.py --synthetic-shape $S --device cuda --dtype bfloat16 --requests 64 \
        --repeats 1 --configs plain,adaptive 2>&1 | grep -v Warn | tee -a $OUT/batching.txt
    ;;
cudaworker)
    tail -2 /root/build-libs.log
    # The installed llama-cpp-python loads libllama (and libggml-cuda beside it) from LLAMA_CPP_LIB_PATH.
    export LLAMA_CPP_LIB_PATH=/root/llama/cuda-libs LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/root/llama/cuda-libs
    # 1. In one process, torch's CUDA first: the crash this phase is about (expected: a signal, exit >= 128).
    python3 -c "import torch; torch.zeros(1, device='cuda'); import tandem
m = tandem.load('$T', backend='llama.cpp', device='cuda', isolation='none'); print('in process: loaded', m)" \
        >$OUT/inprocess.txt 2>&1; echo "in-process exit status $?" | tee -a $OUT/inprocess.txt
    # Which CUDA runtime / cuBLAS files each import maps (two copies of one soname would be the clash).
    python3 -c "import torch; torch.zeros(1, device='cuda'); print(open('/proc/self/maps').read())" \
        | grep -oE '/[^ ]*lib(cudart|cublas)[^ ]*' | sort -u > $OUT/torch_cuda_libs.txt
    LD_DEBUG=libs python3 -c "import llama_cpp" 2>&1 | grep -E 'calling init: .*lib(cudart|cublas|ggml)' \
        > $OUT/llama_cuda_libs.txt; cat $OUT/torch_cuda_libs.txt $OUT/llama_cuda_libs.txt
    # Which import order lets libllama load at all, torch never imported (the worker imports llama.cpp first).
    for order in numpy-first stdcxx-first llama-first; do
        timeout 120 python3 lab/gpu_llamacpp_load_order.py $D $order 2>&1 | grep -E "ok$|Fatal" | tail -1
        echo "== $order exit ${PIPESTATUS[0]}"
    done | tee $OUT/load_order.txt
    # 2. The worker process (auto on a CUDA build beside CUDA torch): equality flags, tok/s, each process's maps.
    python3 lab/gpu_llamacpp_worker.py --model $T --draft $D --max-tokens 128 \
        --json $OUT/llamacpp_worker_cuda.json 2>&1 | grep -v Warn | tail -40
    tandem bench --model $T --draft $D --backend llama.cpp --device cuda --max-tokens 128 --repeats 3 \
        --configs plain,adaptive,ngram --json $OUT/bench_llamacpp_cuda_worker.json 2>&1 | grep -v Warn | tail -15
    ;;
loadtest)
    # tandem starts once per config with --slots = the most clients (CONFIGS=tandem-plain, then =tandem-adaptive,
    # splits it in two calls); timeout: a slow run still stops its servers and prints what it measured. The JSON
    # stays on the box for loadllama's table.
    c=${CONFIGS:-tandem-plain,tandem-adaptive}
    timeout -k 30 550 python3 bench/serve_load.py --model $T --draft $D --device cuda --clients ${CLIENTS:-1,4,16,64} \
        --max-tokens 128 --configs $c --json $OUT/load_$c.json --logs $OUT/logs 2>&1 \
        | grep --line-buffered -v Warn | tee $OUT/load_$c.txt
    cp $OUT/load_$c.json /root/m/
    ;;
loadllama)
    tail -2 /root/build.log
    # llama-server restarts for each load with -np = clients; the table joins loadtest's tandem numbers.
    with=$(for f in /root/m/load_tandem*.json; do [ -f $f ] && echo --with $f; done)
    timeout -k 30 550 python3 bench/serve_load.py --model $T --draft $D --clients ${CLIENTS:-1,4,16,64} \
        --max-tokens 128 --configs ${CONFIGS:-llama-plain,llama-draft} --ngl 99 \
        --llama-server $LLAMA_SERVER $with --json $OUT/load_all.json \
        --logs $OUT/logs 2>&1 | tee $OUT/load_all.txt
    ;;
regimewrite)
    tok=/root/m/T.gguf; [ -f $tok ] || tok=.xfer/qwen-tokenizer.gguf
    mix=${MIX:-Q4_0}; mkdir -p /root/m/big
    for f in /root/m/big/T32_*.gguf; do [ "$f" = /root/m/big/T32_$mix.gguf ] || rm -f "$f"; done
    write() {  # to a temporary name first: a call cut off mid-file leaves nothing that looks finished
        [ -f $1 ] || { python3 -m tandem.synthetic.random_gguf $1.part --shape $2 --mix $3 --tokenizer-from $tok \
            && mv $1.part $1; }
    }
    # TSHAPE / DSHAPE: other shapes (tandem.synthetic.shapes.parse_shape), for a dry run of these phases on a CPU
    write /root/m/big/T32_$mix.gguf ${TSHAPE:-qwen2.5-32b} $mix 2>&1 | tail -3
    write /root/m/big/D1.5b_Q4_0.gguf ${DSHAPE:-qwen2.5-1.5b} Q4_0 2>&1 | tail -1
    write /root/m/big/D0.5b_Q4_0.gguf ${DSHAPE:-qwen2.5-0.5b} Q4_0 2>&1 | tail -1
    ls -la /root/m/big; df -h /root | tail -1
    ;;
regime|regimevk|regimellama)
    BT=/root/m/big/T32_${MIX:-Q4_0}.gguf BD=/root/m/big/D${DRAFT:-1.5b}_Q4_0.gguf
    name=${MIX:-Q4_0}_${DRAFT:-1.5b}
    # REGIME_ARGS: more flags of lab/gpu_report_regime.py (e.g. --max-tokens 32 --repeats 1 for a dry run; they win)
    # REGIME_TIMEOUT: seconds before the run is cut off (the JSON keeps every row measured by then; see --json)
    regime() { timeout -k 10 ${REGIME_TIMEOUT:-560} python3 lab/gpu_report_regime.py --model $BT --draft $BD --acceptance ${ACCEPTANCE:-0.6,0.8} "$@" \
        ${REGIME_ARGS:-}; }
    ;;&
regime)
    if [ -d /root/llama/cuda-libs ]; then  # the CUDA libllama setup built (CUDA_LIBS=1), as in cudaworker
        tail -1 /root/build-libs.log
        export LLAMA_CPP_LIB_PATH=/root/llama/cuda-libs LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/root/llama/cuda-libs
    fi
    regime --device ${DEVICE:-cuda} --parts ${PARTS:-costs,bench} --json /root/m/big/regime_cuda_$name.json \
        2>$OUT/regime_cuda_$name.err | tee $OUT/regime_cuda_$name.txt
    cp /root/m/big/regime_cuda_$name.json $OUT/
    ;;
regimevk)
    # the Vulkan build's libraries first: after a CUDA setup LD_LIBRARY_PATH holds the CUDA build's libggml (a call
    # that ran both found only CUDA and CPU backends here)
    export PYTHONPATH=/root/vk:$PYTHONPATH LLAMA_CPP_LIB_PATH=/root/vk/llama_cpp/lib \
        LD_LIBRARY_PATH=/root/vk/llama_cpp/lib:${LD_LIBRARY_PATH:-}
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    [ -f $icd ] && export VK_DRIVER_FILES=$icd
    regime --device vulkan --parts ${PARTS:-costs,bench} --json /root/m/big/regime_vulkan_$name.json \
        2>$OUT/regime_vulkan_$name.err | tee $OUT/regime_vulkan_$name.txt
    cp /root/m/big/regime_vulkan_$name.json $OUT/
    ;;
regimellama)
    tail -1 /root/build.log 2>/dev/null
    if [ "${REGIME:-cuda}" = vulkan ]; then  # vksetup's llama-server for Vulkan
        SERVER=${SERVER:-/root/vkserver/llama-server}
        export LD_LIBRARY_PATH=/root/vkserver:${LD_LIBRARY_PATH:-}
        icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
        [ -f $icd ] && export VK_DRIVER_FILES=$icd
    fi
    regime --parts server --server ${SERVER:-$LLAMA_SERVER} --ngl 99 \
        --json /root/m/big/regime_${REGIME:-cuda}_$name.json 2>$OUT/regime_llama_$name.err \
        | tee $OUT/regime_llama_$name.txt
    cp /root/m/big/regime_${REGIME:-cuda}_$name.json $OUT/
    ;;
structured)
    python3 bench/structured_throughput.py --model $T --draft $D --backend torch --device cuda --dtype bfloat16 \
        --max-tokens 128 --repeats 3 2>&1 \
        | grep --line-buffered -v Warn | tee $OUT/structured.txt
    ;;
synthetic|synthdoctor)
    tandem doctor --synthetic-shape qwen2.5-32b,qwen2.5-1.5b --device cuda --json > $OUT/doctor_synth_32b.json \
        2>$OUT/doctor_synth.err
    python3 -c "import json; d = json.load(open('$OUT/doctor_synth_32b.json')); print({k: d[k] for k in \
        ('paired_over_standalone', 'target_step_ms', 'draft_step_ms_paired', 'best_draft_len', 'verdict')})"
    ;;&
synthetic|synthbench)
    # stderr kept whole: runs of 2026-12-03f and 04e died with a device-side assert (the draft embedding a target id
    # past its rows, fixed since: h200-2026-12-04e) whose message a `tail` had cut off.
    tandem bench --synthetic-shape qwen2.5-32b,qwen2.5-1.5b --synthetic-acceptance 0.8 --device cuda \
        --max-tokens 256 --configs plain,adaptive,fixed8 --json $OUT/bench_synth_32b.json \
        --plot $OUT/bench_synth_32b.png >$OUT/bench_synth.txt \
        2>$OUT/bench_synth.err
    tail -15 $OUT/bench_synth.txt; grep -v Warn $OUT/bench_synth.err | grep -m 5 -i -B 2 -A 3 "error\|exception"
    ;;
esac
