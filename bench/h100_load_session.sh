#!/usr/bin/env bash
# Issue 52's measurement in one H100 lease: tandem plain, adaptive and the draft at a fixed K under load
# (bench/serve_load.py: 1/4/16/64 clients, 4 requests a client, 128 tokens), the real pair, torch, bf16.
# One phase per device call, the calls back to back (the box goes back after 30 s idle, and what it holds with it):
#   chunk N   N = 0..25, one call each, carrying only .xfer/pNNN (a call carries the tree too, ~4.5 MiB: 64 MiB in
#             all): the piece checked against bench/h100_load_chunks.sha256 and kept as /root/m/pNNN; prints the
#             pieces the box holds (a reply with warm: false after the first means they are gone)
#   last      setup, chunk 26 (27 MiB: it fits beside .whs), pair, load; carry .whs .xfer/p026
#   load      again until it prints "nothing left to measure": each call measures the configurations not yet
#             in /root/m/load.json, one serve_load run each, starting one only while PER_CONFIG seconds are left of
#             LIMIT; every call copies the merged JSON, this call's output and the servers' logs to $OUT
# and on their own: setup (the wheels into $SITE, the GPU, the imports), pair (T.gguf and D.gguf out of the pieces,
# SHA-256 checked), table (the merged table again).
#   random    no transfer: setup, then T.gguf and D.gguf written on the box with random weights of the pair's shapes
#             and its real tokenizer (tandem.synthetic.random_gguf, a few seconds), then load; carry .whs
#             .xfer/qwen-tokenizer.gguf (carries makes it). What needs no acceptance is measured as on the real pair:
#             start cold and warm, conversation TTFT, the draft's presence under load (a random draft is never
#             accepted, so adaptive must equal plain at every load; random weights repeat one token, which prompt
#             lookup would accept: SERVE_ARGS=--tandem-arg=--no-prompt-lookup). Gains need the real pair's acceptance.
#   plan      setup, chunk 26, pair, then `steps` in the background (setsid: it outlives the call, the box stays warm
#             while calls come back to back); carry .whs .xfer/p026 and .lls (llama.cpp's source, for llama-server)
#   poll      waits for the plan (LIMIT s at most), prints its log and copies what it measured to $OUT; again until
#             it prints "plan done". steps: serve_start (cold: a fresh TANDEM_HOME, compiles too; then warm),
#             load_rounds (every config's server at once, interleaved rounds, 1/4/16/64 clients), engine_load in
#             process (16/64 clients, a profile), tandem bench at one request (every prompt, fixed k and lookup), the
#             conversation (beside llama-server with LLAMA=1: built from .lls, sharing the host with the first steps).
# load's settings: CONFIGS (tandem-plain,tandem-adaptive,tandem-fixed1,tandem-fixed2,tandem-fixed3), CLIENTS
# (1,4,16,64), MAX_TOKENS (128), REQS (requests a client, 4), CONVERSATION=1 (the 10-turn chat too), RERUN=1
# (measure CONFIGS again even where measured or failed), LIMIT (560 s a call), PER_CONFIG (220 s: a cold start took
# ~140 s), SERVE_ARGS (more bench/serve_load.py arguments, e.g. --tandem-arg=--flag).
# Phase carries runs here, on the CPU machine, after the README's install (.venv): it makes the git-ignored folders
# the calls carry (/.whs/ and /.xfer/ in .git/info/exclude):
#   .whs   the wheels the box lacks, for its Python 3.12 (~6.3 MiB): WHEELS below, the versions tested together here;
#          and llama-cpp-python's libggml-base.so (0.8 MiB: llama.cpp's dequantisers for the load, TANDEM_GGML_BASE)
#   .xfer  pNNN: the registry's qwen2.5-coder-1.5b-instruct.gguf and -0.5b-instruct.gguf, cat | split -b 58M
set -u
phase=${1:?phase: chunk N, last, load, plan, poll, setup, pair, table, carries}
M=${M:-/root/m} SITE=${SITE:-/tmp/site} WHS=${WHS:-.whs} OUT=${OUT:-/tmp/out} DEVICE=${DEVICE:-cuda}
T=${T:-$M/T.gguf} D=${D:-$M/D.gguf}
T_BYTES=1117320768  # qwen2.5-coder-1.5b-instruct.gguf (Q4_K_M); the draft, qwen2.5-coder-0.5b-instruct, follows it
T_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
D_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SUMS=bench/h100_load_chunks.sha256
WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3
    uvicorn==0.55.0 gguf==0.19.0 llguidance==1.9.1"
JSON=$M/load.json

setup() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHS"/*.whl || exit 1
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    fi
    python3 -c "import sys, torch, fastapi, uvicorn, pydantic, gguf, llguidance, tandem.server.serve
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.VERSION)" || exit 1
}

chunk() {
    local n; n=$(printf %03d "$1")
    local want; want=$(awk -v p="p$n" '$2 == p {print $1}' $SUMS)
    [ -n "$want" ] || { echo "no piece p$n in $SUMS"; exit 1; }
    if [ "$(sha256sum < .xfer/p$n | cut -c1-64)" = "$want" ]; then
        cp .xfer/p$n "$M/p$n.part" && mv "$M/p$n.part" "$M/p$n"
    else
        echo "p$n: SHA-256 mismatch (or not carried)"; exit 1
    fi
    local have; have=$(cd "$M" && ls p??? 2>/dev/null | tr '\n' ' ')
    echo "the box holds $(wc -w <<< "$have") of $(grep -c ' p[0-9]' $SUMS) pieces: $have"
}

random_pair() {  # the pair's shapes with random weights: what the issue's goals measure without acceptance
    local tok=.xfer/qwen-tokenizer.gguf
    [ -f "$tok" ] || { echo "carry $tok (bash bench/h100_load_session.sh carries makes it)"; exit 1; }
    python3 -m tandem.synthetic.random_gguf "$T" --shape qwen2.5-coder-1.5b --mix Q4_K_M --tokenizer-from $tok &
    python3 -m tandem.synthetic.random_gguf "$D" --shape qwen2.5-coder-0.5b --mix Q4_K_M --tokenizer-from $tok &
    wait && [ -f "$T" ] && [ -f "$D" ] && touch "$M/pair.ok"
}

pair() {
    if [ -f "$T" ] && [ -f "$D" ] && [ -f "$M/pair.ok" ]; then echo "pair already checked"; return; fi
    local missing; missing=$(awk '$2 ~ /^p[0-9]+$/ {print $2}' $SUMS | while read -r p; do
        [ -f "$M/$p" ] || echo -n "$p "; done)
    [ -z "$missing" ] || { echo "pieces missing on the box: $missing"; exit 1; }
    cat "$M"/p??? > "$M/pair.bin" && head -c $T_BYTES "$M/pair.bin" > "$T" && tail -c +$((T_BYTES + 1)) \
        "$M/pair.bin" > "$D" && rm "$M/pair.bin" || exit 1
    printf '%s  %s\n%s  %s\n' $T_SHA "$T" $D_SHA "$D" | sha256sum -c || exit 1
    rm -f "$M"/p??? && touch "$M/pair.ok"
}

measured() {  # $1: a configuration; true where load.json has every client count of it, or its failure (said unless $2)
    python3 - "$JSON" "$1" "${CLIENTS:-1,4,16,64}" "${2:-}" <<'PY'
import json, sys
path, name, clients, quiet = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
try:
    r = json.load(open(path))["configs"].get(name)
except OSError:
    r = None
if r and r["errors"] and not quiet:
    print(f"{name} failed in an earlier call (RERUN=1 CONFIGS={name}: again); its first error:\n{r['errors'][0][:600]}")
sys.exit(0 if r and (r["errors"] or all(c in r["loads"] for c in clients)) else 1)
PY
}

serve_load() {  # $1: seconds it may run (then SIGTERM: it stops its server, keeps what it measured); more arguments
    # for bench/serve_load.py. The merged JSON is replaced only by a whole one.
    local secs=$1; shift
    local with=(); [ -f "$JSON" ] && with=(--with "$JSON")
    timeout -k 30 "$secs" python3 bench/serve_load.py --model "$T" --draft "$D" --device "$DEVICE" \
        --clients "${CLIENTS:-1,4,16,64}" --max-tokens "${MAX_TOKENS:-128}" --requests-per-client "${REQS:-4}" \
        --tandem-arg=--backend --tandem-arg=torch ${SERVE_ARGS:-} "${with[@]}" --json "$JSON.part" "$@"
    python3 -c "import json, sys; json.load(open(sys.argv[1]))" "$JSON.part" 2>/dev/null && mv "$JSON.part" "$JSON"
}

load() {
    local limit=${LIMIT:-560} per_config=${PER_CONFIG:-220} left=() ran=0
    local turns=(--no-conversation); [ "${CONVERSATION:-0}" = 1 ] && turns=()
    # A server an earlier call left running (its serve_load killed) would share the GPU: stopped by its pid
    if [ "$DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then
        for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
            echo "stopping process $pid left on the GPU"; kill "$pid"; sleep 5; kill -9 "$pid" 2>/dev/null
        done
    fi
    for c in $(tr , ' ' <<< "${CONFIGS:-tandem-plain,tandem-adaptive,tandem-fixed1,tandem-fixed2,tandem-fixed3}"); do
        if [ "${RERUN:-0}" != 1 ] && measured "$c"; then continue; fi
        if ((SECONDS + per_config > limit)); then left+=("$c"); continue; fi
        echo "== $c (${SECONDS} s into this call)"; ran=1
        # SIGTERM first: serve_load stops its server and keeps what it measured; the next call measures it again
        serve_load $((limit - SECONDS)) --configs "$c" --logs "$M/logs/$c" "${turns[@]}" 2>&1 \
            | grep --line-buffered -v Warn | tee -a "$OUT/load.txt"
        measured "$c" quiet || left+=("$c")
    done
    [ $ran = 1 ] || [ ! -f "$JSON" ] || serve_load 60 --configs ""  # the table, where no run printed it
    [ -f "$JSON" ] && cp "$JSON" "$OUT/load.json"
    [ -d "$M/logs" ] && tar czf "$OUT/logs.tgz" -C "$M" logs
    if [ ${#left[@]} = 0 ]; then echo "nothing left to measure (a configuration that failed is not tried again)"
    else echo "left for the next call: ${left[*]}"; fi
}

STEPS_CONFIGS=${CONFIGS:-tandem-plain,tandem-adaptive,tandem-draft,tandem-fixed1,tandem-fixed2,tandem-fixed3}
TORCH=(--tandem-arg=--backend --tandem-arg=torch)
step() {  # $1: a name; the rest: a command, run with its output in $M/$1.txt and its time in the plan's log
    local name=$1; shift
    echo "== $name ($(date +%T), ${SECONDS} s into the plan)"
    "$@" > "$M/$name.txt" 2>&1; local rc=$?
    tail -n "${TAIL:-25}" "$M/$name.txt" | grep -v Warn; echo "== $name: rc $rc after ${SECONDS} s"
}

llama_server() {  # llama-server's CUDA build from llama-cpp-python's vendored source (.lls), niced beside the plan
    [ -f .lls/llama.cpp.tar.xz ] || { echo "no .lls/llama.cpp.tar.xz: no llama-server"; return 1; }
    mkdir -p "$M/lls" && tar xJf .lls/llama.cpp.tar.xz -C "$M/lls" && cd "$M/lls/llama.cpp" &&
        cmake -B b -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=off -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$M/lls.txt" 2>&1 &&
        nice -n 19 cmake --build b -j 8 --target llama-server >> "$M/lls.txt" 2>&1 && cp b/bin/llama-server "$M/"
}

steps() {
    unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR  # tandem keeps its compiles under TANDEM_HOME: cold means fresh
    export TANDEM_HOME=$M/home
    # llama-server only with LLAMA=1: its build shares the host with the start and the rounds (the 07i lease: the
    # costs were kept as measured on a busy machine, and measured again mid-rounds)
    if [ "${LLAMA:-0}" = 1 ]; then (llama_server; echo "llama-server build: rc $?") > "$M/lls.done" 2>&1 &
    else echo "no llama-server (LLAMA=1 builds it)" > "$M/lls.done"; fi
    local serve=(--model "$T" --draft "$D" --device cuda --backend torch --slots 64 --ctx 2048)
    step start python3 bench/serve_start.py --home "$TANDEM_HOME" --cases cold,warm --log "$M/start.log" \
        --json "$M/start.json" -- "${serve[@]}"
    step rounds python3 bench/load_rounds.py --model "$T" --draft "$D" --device cuda --configs "$STEPS_CONFIGS" \
        --clients 1,4,16,64 --requests-per-client "${REQS:-4}" --max-tokens "${MAX_TOKENS:-128}" \
        --rounds "${ROUNDS:-3}" "${TORCH[@]}" --tandem-arg=--ctx --tandem-arg=2048 --logs "$M/logs/rounds" \
        --json "$M/rounds.json"
    step engine-load python3 bench/engine_load.py --model "$T" --draft "$D" --device cuda --dtype bfloat16 \
        --clients 16,64 --configs plain,adaptive,adaptive-draft,fixed1 --rounds 2 --max-tokens 128 \
        --requests-per-client 2 --profile 40
    step one-request python3 -m tandem.cli bench --model "$T" --draft "$D" --device cuda --backend torch \
        --configs plain,adaptive,draft,fixed1,fixed2,fixed3,fixed4,ngram --repeats 3 --json "$M/one-request.json"
    local waited=0
    while [ ! -s "$M/lls.done" ] && ((waited < 240)); do sleep 5; waited=$((waited + 5)); done
    cat "$M/lls.done"; [ -f "$M/lls.txt" ] && tail -3 "$M/lls.txt"
    local llama=(); [ -x "$M/llama-server" ] && llama=(--llama-server "$M/llama-server" --ngl 99)
    step conversation python3 bench/conversation_rounds.py --model "$T" --draft "$D" --device cuda "${TORCH[@]}" \
        --configs "tandem-plain,tandem-adaptive${llama:+,llama-plain}" "${llama[@]}" --rounds 3 \
        --json "$M/conversation.json"
    echo "plan done"
}

plan() {
    if [ -f "$M/plan.pid" ] && kill -0 "$(cat "$M/plan.pid")" 2>/dev/null; then echo "the plan runs already"; return; fi
    setsid nohup bash bench/h100_load_session.sh steps > "$M/plan.log" 2>&1 < /dev/null &
    echo $! > "$M/plan.pid"; sleep 20; cat "$M/plan.log"
}

poll() {
    local limit=${LIMIT:-540}
    while ! grep -q "^plan done" "$M/plan.log" && kill -0 "$(cat "$M/plan.pid")" 2>/dev/null && ((SECONDS < limit)); do
        sleep 5
    done
    cat "$M/plan.log"; nvidia-smi --query-gpu=memory.used --format=csv,noheader
    for f in "$M"/*.json "$M"/plan.log; do [ -f "$f" ] && cp "$f" "$OUT/"; done
    (cd "$M" && tar czf "$OUT/texts.tgz" $(ls -d ./*.txt ./logs ./start.log 2>/dev/null))
}

carries() {
    local py=${PY:-.venv/bin/python} platforms=() n
    for n in 17 28 31; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    for d in /.whs/ /.xfer/; do grep -qxF $d .git/info/exclude 2>/dev/null || echo $d >> .git/info/exclude; done
    rm -rf .whs && $py -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 "${platforms[@]}" --no-deps -d .whs $WHEELS || exit 1
    # llama.cpp's dequantisers for the torch backend's load (the box has no llama-cpp-python): TANDEM_GGML_BASE
    cp -L "$($py -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('llama_cpp').submodule_search_locations[0], 'lib', 'libggml-base.so'))")" .whs/ || exit 1
    local models; models=$($py -c "from tandem.loading import registry
for name in ('qwen2.5-coder-1.5b-instruct', 'qwen2.5-coder-0.5b-instruct'): print(registry.pull(name, progress=False))")
    [ -n "$models" ] || exit 1
    rm -rf .xfer && mkdir .xfer && cat $models | split -b 58M -d -a 3 - .xfer/p
    (cd .xfer && grep ' p[0-9]' "../$SUMS" | sha256sum -c --quiet) || exit 1
    $py -m tandem.synthetic.random_gguf .xfer/qwen-tokenizer.gguf --extract-tokenizer "$(head -1 <<< "$models")" \
        && du -sh .whs .xfer
}

[ "$phase" = carries ] && { carries; exit; }
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -f "$WHS/libggml-base.so" ] && export TANDEM_GGML_BASE=$PWD/$WHS/libggml-base.so  # the load's fast dequantisers
# Compiles and the adaptive policy's measured costs kept for the next server start in this lease
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/root/inductor} TANDEM_HOME=${TANDEM_HOME:-/root/th} \
    TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/root/triton}
mkdir -p "$M" "$OUT"
case $phase in
setup) setup ;;
chunk) chunk "${2:?chunk N}" ;;
pair) pair ;;
load) load ;;
last) setup && chunk 26 && pair && load ;;
random) setup && random_pair && load ;;
plan) setup && chunk 26 && pair && plan ;;
steps) steps ;;
poll) poll ;;
table) serve_load 60 --configs "" | tee "$OUT/table.txt"; cp "$JSON" "$OUT/load.json" ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
