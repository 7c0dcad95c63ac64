set -e
M=$(cd /work/main && .venv/bin/python -c "from tandem.loading.registry import DEFAULT_TARGET; from tandem.loading.registry import resolve; print(resolve(DEFAULT_TARGET))" 2>/dev/null || true)
[ -n "$M" ] || M=/root/.cache/tandem/models/qwen2.5-coder-1.5b-instruct.gguf
/tmp/ls/llama.cpp.src/b2/bin/llama-server -m $M --port 8399 --host 127.0.0.1 -ngl 0 -c 4096 -np 1 -t 2 --no-webui > /tmp/prof/server.log 2>&1 &
PID=$!
for i in $(seq 60); do curl -s localhost:8399/health | grep -q ok && break; sleep 1; done
cat > /tmp/prof/req.py <<'PY'
import json, sys, urllib.request
sys.path.insert(0, "/work/main")
from tandem.bench.suite import load_suite
msgs = list(load_suite("default", "code")[0].messages)
n = int(sys.argv[1])
body = json.dumps({"messages": msgs, "max_tokens": n, "temperature": 0, "ignore_eos": True}).encode()
r = json.loads(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8399/v1/chat/completions", body, {"Content-Type": "application/json"})).read())
print(round(r["timings"]["predicted_per_second"], 2), r["usage"])
PY
/work/main/.venv/bin/python /tmp/prof/req.py 8
perf record -F 999 -p $PID -o /tmp/prof/server.data &
PP=$!
sleep 1
for i in 1 2 3; do /work/main/.venv/bin/python /tmp/prof/req.py 128; done
kill -INT $PP; sleep 2
kill $PID
