#!/usr/bin/env bash
# Issue 26's H200 session, one device call per step, back to back (the box goes cold 30 s after a call):
#   run(carry=[".whs", ".xfer", ".vk", ".gl", ".vkserver"], "bash lab/h200_regime_session.sh 1")
#       setup (the CUDA build starts in the background), the random GGUFs, then on Vulkan: the regime and llama-server
#       plain on the same files
#   run(carry=[".whl"], "bash lab/h200_regime_session.sh 2")
#       the CUDA regime (waits for the build) and llama-server plain; steps 1 and 2 also time shape changes (as g; G=0:
#       not), on Vulkan and CUDA
#   run("bash lab/h200_regime_session.sh 3")  llama-server with the draft, Vulkan and CUDA (if time is left)
#   run(carry=[".whs", ".xfer/qwen-tokenizer.gguf", ".vk", ".gl", ".vkserver"], "bash lab/h200_regime_session.sh v")
#       Vulkan alone in one call (no CUDA build: llama-src stays behind), for a session with ~11 device-minutes
#   run(same carry as v, "bash lab/h200_regime_session.sh e")  Vulkan, the regime alone (ACC, default 0.8; T1)
#   run(carry=[".whs", ".whp", ".xfer/qwen-tokenizer.gguf", ".cuda", ".vkx", ".gl"], "bash lab/h200_regime_session.sh r")
#       one request on CUDA, then on Vulkan, in one call (.vkx: .vk as a tarball, `tar -C .vk -cf - llama_cpp | xz`);
#       rc: CUDA alone, rv: Vulkan alone (with lab/catch_up_rows.py on the draft first, CU=0: not; it needs no CUDA
#       build, so it can run while setup's CUDA compile goes on in the background: carry .xfer whole, no .cuda);
#       TREES="new old": this tree, then .old's tandem (carry .old), each run's files under $OUT/new and $OUT/old;
#       DRAFT=0.5b: the 0.5B-shape draft (regimewrite writes both)
#   run(same carry as v, "bash lab/h200_regime_session.sh t")  Vulkan, lab/regime_trace.py: the engine's plans
#   run("bash lab/h200_regime_session.sh tc")  CUDA, the same, right after step 2 (its build): plans, what the loop
#       learned, and each step's target forward apart from its host work
#   run(carry=[".whl", ".whs", ".old"], "bash lab/h200_regime_session.sh o")  torch, one request (tandem bench,
#       synthetic 32B/1.5B bf16, acceptance 0.8): this tree and an earlier one (.old) in one call
#   run(carry=[".old"], "bash lab/h200_regime_session.sh cs")  CUDA, after regimewrite and the build:
#       lab/calibration_spread.py (the calibration ROUNDS times, then its feed-ahead forwards one by one), this
#       tree and .old (git archive REV tandem | tar x -C .old); and lab/catch_up_rows.py on the draft
#   run("bash lab/h200_regime_session.sh P")  after setup with CUDA_LIBS=1: the CUDA build (libraries and
#       llama-server) back in pieces; kept in .cuda (git-ignored, 43 MB), a later setup with CUDA_LIBS=1 unpacks it
#       instead of compiling. With it, .whp (llama_cpp_python's wheel without its CPU libraries, 143 KB: the CUDA
#       libraries come from .cuda through LLAMA_CPP_LIB_PATH) replaces .whl (carry one of the two, never both), and
#       one call holds everything: run(carry=[".whs", ".whp", ".xfer/qwen-tokenizer.gguf", ".cuda"],
#       "CUDA_LIBS=1 bash lab/h200.sh setup; bash lab/h200.sh regimewrite; ... h200_regime_session.sh 2")
#   run("bash lab/h200_regime_session.sh bs")  CUDA, after regimewrite: lab/llamacpp_backend_sampling.py on the
#       32B target and the 1.5B draft (what picking greedy tokens on the device instead of reading logits saves)
#   run("bash lab/h200_regime_session.sh ep")  CUDA, after regimewrite: lab/llamacpp_episode.py (a drafting
#       episode's forwards timed by place: graphs on and off, the draft's forwards between or not, CPU threads;
#       EPISODES B:k ..., VARIANTS a comma list)
#   run("bash lab/h200_regime_session.sh dp")  CUDA, after regimewrite: bench/draft_pairing.py (the draft step alone,
#       beside the idle target, between verifies, alone again; CUDA graphs on and off: DP_VARIANTS)
#   run(same carry as r, "bash lab/h200_regime_session.sh dpv")  Vulkan: bench/draft_pairing.py --causes (the host's
#       caches swept, a sleep after the verify, the verify on a thread of its own: what makes the paired step slower)
#   run(same carry as v, "bash lab/h200_regime_session.sh g")  Vulkan, lab/llamacpp_graph_reuse.py: what a change
#       of forward shape costs the 32B target and the 1.5B draft (llama.cpp rebuilds its graph)
# Each step fits one 10-minute call: the regime is cut off at REGIME_TIMEOUT and keeps every row measured.
# Carried paths (git-ignored, listed in .git/info/exclude), made on the CPU machine (lab/make_carries.sh makes
# .whs, .whp, .xfer, .gl and .vkx on a fresh one):
#   .whp       llama_cpp_python's wheel with its lib/ dirs dropped (and from RECORD): the Python package alone
#   .whl       wheels: llama_cpp_python (CPU build; its Python package, CUDA_LIBS=1 swaps in CUDA libraries),
#              llguidance; .whs: gguf, diskcache
#   .xfer      llama-src.tar.xz (llama-cpp-python 0.3.36's vendored llama.cpp, no build*/docs/models/media),
#              qwen-tokenizer.gguf (python -m tandem.synthetic.random_gguf ... --extract-tokenizer REAL.gguf)
#   .vk        llama_cpp/ of llama-cpp-python 0.3.36 built with -DGGML_VULKAN=on (as .ci/vulkan), one copy per
#              library soname (libllama.so, libggml*.so.0), 34 MB; .gl: Debian's libvulkan1 (the loader) and libglvnd0,
#              libglx0, libgl1, libegl1, libopengl0, libgles2 .debs: NVIDIA's Vulkan driver is libGLX_nvidia, which
#              needs glvnd (without them: "Could not get 'vkCreateInstance'", no Vulkan device; device README's list)
#   .vkserver  llama-server built for Vulkan from the same tree (BUILD_SHARED_LIBS=ON): llama-server,
#              libllama-server-impl.so, libllama-common.so.0, libmtmd.so.0 (runs on .vk's libraries)
export PYTHONPATH=/tmp/site:$PWD
# the byte floor's bandwidth: the lent box may be an H100 (3.35 TB/s) where an H200 (4.8) was asked for
BW=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && echo 3350 || echo 4800)
table() { python3 lab/gpu_report_regime.py --model x --draft y --parts "" --json $1 2>&1 | tail -24; cp $1 $OUT/; }
# --step-parts: each engine row also says where its steps' time went (lab/step_parts.py), no separate trace call
A="--repeats ${REPEATS:-2} --prompts 2 --cost-repeats 5 --bandwidth-gbs $BW --step-parts ${REGIME_EXTRA:-}"
plain_server() { ACCEPTANCE=0.8 REGIME_ARGS="--repeats 3 --server-configs plain" REGIME_TIMEOUT=$1 REGIME=$2 \
    bash lab/h200.sh regimellama > /dev/null 2>&1; tail -3 $OUT/regime_llama_*.err; }
# vulkan TIMEOUT SERVER_TIMEOUT: llama.cpp for Vulkan set up, the regime on it, then llama-server plain, the table
vulkan() { bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1; local rc=$?; tail -3 /tmp/vksetup.log
    [ $rc = 0 ] || { echo "no Vulkan device: the regime on Vulkan skipped"; return 1; }
    ACCEPTANCE=0.8,0.6 REGIME_ARGS="$A" REGIME_TIMEOUT=$1 bash lab/h200.sh regimevk > /dev/null 2>&1
    tail -3 $OUT/regime_vulkan_*.err; plain_server $2 vulkan; table /root/m/big/regime_vulkan_Q4_0_1.5b.json; }
# graph DEVICE: what a change of forward shape costs the 32B target and the 1.5B draft (needs the device's libraries on
# PYTHONPATH / LLAMA_CPP_LIB_PATH, as the caller sets them)
graph() { for m in T32_Q4_0 D1.5b_Q4_0; do timeout 120 python3 lab/llamacpp_graph_reuse.py --model /root/m/big/$m.gguf \
    --device $1 --rows 1,2,3 --repeats 20 2>/dev/null | tee $OUT/graph_reuse_$1_$m.txt | head -7; done; }
# cudaenv: the CUDA build's libraries (setup's, or unpacked from .cuda) for llama-cpp-python
cudaenv() { local d=/root/llama/cuda-libs; export LLAMA_CPP_LIB_PATH=$d LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:$d; }
# wait_build: until setup's CUDA build (CUDA_LIBS=1, compiled or unpacked from .cuda) is done
wait_build() { [ -f /root/build-libs.log ] || { echo "no CUDA build under way (setup with CUDA_LIBS=1)"; exit 1; }
    while ! grep -q build-exit /root/build-libs.log; do sleep 3; done; tail -1 /root/build-libs.log; }
# in_tree TREE CMD...: CMD run with TREE's tandem (new: this tree's; another, e.g. old: .old, made by `git archive REV
# tandem | tar x -C .old`), this tree's bench scripts, and its outputs under $OUT/TREE
in_tree() { local tree=$1 dir=$PWD; shift; [ $tree != new ] && { dir=$PWD/.$tree; ln -sfn $PWD/bench $dir/bench; }
    mkdir -p $OUT/$tree; (cd $dir && OUT=$OUT/$tree "$@"); }
vkenv() { export PYTHONPATH=/root/vk:$PYTHONPATH LLAMA_CPP_LIB_PATH=/root/vk/llama_cpp/lib \
    LD_LIBRARY_PATH=/root/vk/llama_cpp/lib:${LD_LIBRARY_PATH:-}
    local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; [ -f $icd ] && export VK_DRIVER_FILES=$icd; }
case $1 in
1) CUDA_LIBS=1 bash lab/h200.sh setup 2>&1 | tail -3; bash lab/h200.sh regimewrite 2>&1 | tail -4
   if [ "${G:-1}" = 1 ]; then bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 && (vkenv; graph vulkan); fi
   vulkan ${T1:-220} ${S1:-100}; tail -2 /root/build-libs.log ;;
2) bash lab/h200.sh wheels
   wait_build
   ACCEPTANCE=${ACCS:-0.8,0.6} REGIME_ARGS="$A" REGIME_TIMEOUT=${T2:-280} bash lab/h200.sh regime > /dev/null 2>&1
   tail -3 $OUT/regime_cuda_*.err; plain_server ${S2:-120} cuda; table /root/m/big/regime_cuda_Q4_0_1.5b.json
   if [ "${G:-1}" = 1 ]; then (cudaenv; graph cuda); fi ;;  # G=0: not, and exit 0
3) ACCEPTANCE=0.8 REGIME_ARGS="--repeats 2 --server-configs draft" REGIME_TIMEOUT=270 REGIME=vulkan \
       bash lab/h200.sh regimellama > /dev/null 2>&1
   ACCEPTANCE=0.8 REGIME_ARGS="--repeats 2 --server-configs draft" REGIME_TIMEOUT=270 bash lab/h200.sh regimellama \
       > /dev/null 2>&1
   tail -3 $OUT/regime_llama_*.err; table /root/m/big/regime_vulkan_Q4_0_1.5b.json
   table /root/m/big/regime_cuda_Q4_0_1.5b.json ;;
v) bash lab/h200.sh setup 2>&1 | tail -3; bash lab/h200.sh regimewrite 2>&1 | tail -4  # Vulkan alone, one call
   vulkan ${T1:-340} ${S1:-120} ;;
e) bash lab/h200.sh setup 2>&1 | tail -3; bash lab/h200.sh regimewrite 2>&1 | tail -4  # the engine alone, Vulkan
   bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 || { tail -3 /tmp/vksetup.log; exit 1; }
   ACCEPTANCE=${ACC:-0.8} REGIME_ARGS="$A --fixed 2" REGIME_TIMEOUT=${T1:-300} bash lab/h200.sh regimevk \
       > /dev/null 2>&1; tail -12 $OUT/regime_vulkan_*.err; table /root/m/big/regime_vulkan_Q4_0_1.5b.json ;;
r|rc|rv) [ -f /root/m/big/T32_Q4_0.gguf ] || { (CUDA_LIBS=1 bash lab/h200.sh setup  # one request, PROMPTS
       bash lab/h200.sh regimewrite) > $OUT/setup.log 2>&1; }  # of them: r on both builds, rc CUDA, rv Vulkan
   ;;&
r|rc) wait_build  # TREES="new old": each tree in turn (see in_tree)
   for tree in ${TREES:-new}; do echo "== $tree"; in_tree $tree eval 'ACCEPTANCE=${ACC:-0.8} \
       REGIME_ARGS="$A --concurrency 1 --prompts ${PROMPTS:-4}" REGIME_TIMEOUT=${T2:-200} bash lab/h200.sh regime \
       > /dev/null 2>&1; table /root/m/big/regime_cuda_Q4_0_${DRAFT:-1.5b}.json'; done ;;&
r|rv) bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 || { tail -3 /tmp/vksetup.log; exit 1; }
   [ "${CU:-1}" = 1 ] && (vkenv; timeout 60 python3 lab/catch_up_rows.py --model /root/m/big/D1.5b_Q4_0.gguf \
       --device vulkan 2>/dev/null | tee $OUT/catch_up_rows_vulkan.txt)
   for tree in ${TREES:-new}; do echo "== $tree"; in_tree $tree eval 'ACCEPTANCE=${ACC:-0.8} \
       REGIME_ARGS="$A --concurrency 1 --prompts ${PROMPTS:-4} --fixed 2" REGIME_TIMEOUT=${T1:-200} \
       bash lab/h200.sh regimevk > /dev/null 2>&1; table /root/m/big/regime_vulkan_Q4_0_${DRAFT:-1.5b}.json'; done ;;
rc) ;;
t) bash lab/h200.sh setup 2>&1 | tail -3; bash lab/h200.sh regimewrite 2>&1 | tail -4  # the engine's plans, Vulkan
   bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 || { tail -3 /tmp/vksetup.log; exit 1; }
   vkenv; export PYTHONPATH=$PYTHONPATH:$PWD/bench
   timeout ${T1:-240} python3 lab/regime_trace.py --model /root/m/big/T32_Q4_0.gguf --draft /root/m/big/D1.5b_Q4_0.gguf \
       --device vulkan --acceptance ${ACC:-0.8} --concurrency ${CONC:-1,2} --repeats 1 --prompts 2 --fixed '' \
       2>$OUT/trace.err | tee $OUT/trace.txt ;;
g) bash lab/h200.sh setup 2>&1 | tail -3; bash lab/h200.sh regimewrite 2>&1 | tail -4  # shape changes, Vulkan
   bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 || { tail -3 /tmp/vksetup.log; exit 1; }
   vkenv; graph vulkan ;;
tc) cudaenv; export PYTHONPATH=$PYTHONPATH:$PWD/bench  # CUDA: after step 2 on the same box (its build)
   timeout ${T1:-240} python3 lab/regime_trace.py --model /root/m/big/T32_Q4_0.gguf --draft /root/m/big/D1.5b_Q4_0.gguf \
       --device cuda --acceptance ${ACC:-0.8} --concurrency ${CONC:-2} --repeats 1 --prompts 1 --fixed '' \
       2>$OUT/trace.err | tee $OUT/trace_cuda.txt ;;
o) bash lab/h200.sh wheels  # one request on torch (bf16, synthetic 32B/1.5B): this tree, and with TREES="new old"
   # an earlier tree's tandem/ carried in .old (git archive REV tandem | tar x -C .old; any other name X: .X), each in
   # a process of its own
   for tree in ${TREES:-new old}; do dir=$PWD; [ $tree != new ] && dir=$PWD/.$tree
       (cd $dir && PYTHONPATH=/tmp/site TANDEM_COMPILE=${COMPILE:-0} timeout ${TO:-280} python3 -m tandem.cli bench \
           --synthetic-shape ${SHAPES:-qwen2.5-32b,qwen2.5-1.5b} --synthetic-acceptance ${ACC:-0.8} \
           --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --max-tokens ${MAXTOK:-192} --configs plain,adaptive \
           --prompts ${PROMPTS:-code,json} --repeats ${REPEATS:-1} --json $OUT/one_request_$tree.json \
           > $OUT/one_request_$tree.txt 2> $OUT/one_request_$tree.err); echo "$tree: exit $?"
       tail -8 $OUT/one_request_$tree.txt; done ;;
bs) cudaenv
   for m in T32_Q4_0 D1.5b_Q4_0; do  # after regimewrite, CUDA: tokens picked on the device against logits read back
       timeout 150 python3 lab/llamacpp_backend_sampling.py --model /root/m/big/$m.gguf --gpu-layers 99 \
           --rows 1,2,4,9,16 2>/dev/null | tee $OUT/backend_sampling_$m.txt; done ;;
ep) cudaenv
   for bk in ${EPISODES:-2:2 2:6 1:3}; do  # after regimewrite, CUDA: a drafting episode's forwards by place
       timeout 150 python3 lab/llamacpp_episode.py --model /root/m/big/T32_Q4_0.gguf \
           --draft /root/m/big/D1.5b_Q4_0.gguf --device cuda --sequences ${bk%:*} --draft-len ${bk#*:} \
           ${VARIANTS:+--variants "$VARIANTS"} \
           2>&1 | tee $OUT/episode_${bk/:/_}.txt | head -24; done ;;
dpv) [ -f /root/m/big/T32_Q4_0.gguf ] || { (CUDA_LIBS=1 bash lab/h200.sh setup; bash lab/h200.sh regimewrite) \
       > $OUT/setup.log 2>&1; }  # Vulkan (carry as rv): bench/draft_pairing.py with the phases that tell host from device
   bash lab/h200.sh vksetup > /tmp/vksetup.log 2>&1 || { tail -3 /tmp/vksetup.log; exit 1; }
   for t in ${DP_THREADS:-auto 1}; do echo "== llama.cpp CPU threads: $t"  # 1: no OpenMP team beside the recording
       (vkenv; timeout ${T1:-150} python3 bench/draft_pairing.py --model /root/m/big/T32_Q4_0.gguf \
           --draft /root/m/big/D1.5b_Q4_0.gguf --device vulkan --k ${K:-2} --causes $([ $t = auto ] || echo --threads $t) \
           --json $OUT/draft_pairing_vulkan_$t.json 2>$OUT/draft_pairing_vulkan_$t.err \
           | tee $OUT/draft_pairing_vulkan_$t.txt); done ;;
dp) cudaenv  # after regimewrite, CUDA: the draft's step alone, beside the idle target, between verifies, by phase
   for v in ${DP_VARIANTS:-graphs nographs}; do
       [ $v = nographs ] && export GGML_CUDA_DISABLE_GRAPHS=1
       timeout 150 python3 bench/draft_pairing.py --model /root/m/big/T32_Q4_0.gguf --draft /root/m/big/D1.5b_Q4_0.gguf \
           --device cuda --k ${K:-3} --json $OUT/draft_pairing_$v.json 2>$OUT/draft_pairing_$v.err \
           | tee $OUT/draft_pairing_$v.txt; done; unset GGML_CUDA_DISABLE_GRAPHS ;;
cs) cudaenv; wait_build
   for tree in ${TREES:-new old}; do dir=$PWD; [ $tree != new ] && dir=$PWD/.$tree
       PYTHONPATH=/tmp/site:$dir timeout ${T1:-150} python3 lab/calibration_spread.py --model /root/m/big/T32_Q4_0.gguf \
           --draft /root/m/big/D1.5b_Q4_0.gguf --device cuda --rounds ${ROUNDS:-4} 2>$OUT/spread_$tree.err \
           | tee $OUT/spread_$tree.txt; done
   timeout 60 python3 lab/catch_up_rows.py --model /root/m/big/D1.5b_Q4_0.gguf --device cuda 2>/dev/null \
       | tee $OUT/catch_up_rows_cuda.txt ;;
P) wait_build  # bring the build back
   # (setup's CUDA_LIBS=1 build, and llama-server): pieces of at most 15 MiB under $OUT, kept here in .cuda
   cp -a /root/llama-libs/llama.cpp.src/build/bin/llama-server /root/llama/cuda-libs/
   du -sh /root/llama/cuda-libs; tar -C /root/llama -cf - cuda-libs | xz -T0 -6 | split -b 15M -d -a 1 - \
       $OUT/cuda-libs.tar.xz.; ls -la $OUT ;;
*) echo "step 1-3, v, e, r, rc, rv, t, tc, g, o, bs, ep, dp, dpv, cs or P"; exit 2 ;;
esac
