"""Seconds from `tandem serve` launched to GET /health's first 200, cold (no kept costs) and warm (a restart), quiet
and beside a busy process (`python -c "while True: pass"`), as a new user meets it on a small CPU machine (issue 47).

    python bench/serve_start.py --home /tmp/th47 --json out.json [-- extra serve arguments]

Each start polls /health every POLL_S and records the bodies it answered (the warm-up's progress) on the way;
--settle keeps each server until its costs are measured in full (the idle refinement), and says how long that took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

POLL_S = 0.25
BUSY = [sys.executable, "-c", "while True: pass"]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> tuple[float, list[dict]]:
    """(seconds to the first 200, the distinct 503 bodies seen on the way)."""
    started, bodies = time.monotonic(), []
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return time.monotonic() - started, bodies
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            if not bodies or body != bodies[-1]:
                bodies.append(body)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"not ready after {timeout_s} s")


def wait_measured(url: str, timeout_s: float) -> float | None:
    """Seconds until /health's costs are a full measurement, made now or kept from the last start, and no other is
    under way or waited for; None past timeout_s."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            costs = json.loads(r.read()).get("costs") or {}
        if not costs or ("measuring" not in costs and str(costs.get("source")).startswith(("measured", "kept"))):
            return time.monotonic() - started
        time.sleep(1.0)
    return None


def one_start(args: argparse.Namespace, extra: list[str], busy: bool) -> dict:
    env = dict(os.environ, TANDEM_HOME=args.home)
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(args.port), *extra]
    load = [subprocess.Popen(BUSY) for _ in range(args.busy_jobs)] if busy else []
    try:
        with open(args.log, "ab") as log:
            launched = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
            try:
                url = f"http://127.0.0.1:{args.port}"
                _, bodies = wait_ready(url, proc, args.timeout)
                ready_s = time.monotonic() - launched
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    bodies.append(json.loads(r.read()))
                measured_s = wait_measured(url, args.timeout) if args.settle else None
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        for p in load:
            p.kill()
            p.wait()
    out = {"ready_s": round(ready_s, 1), "progress": bodies[-8:]}
    if args.settle:
        out["measured_after_ready_s"] = None if measured_s is None else round(measured_s, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", required=True, help="TANDEM_HOME with the default pair pulled")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--busy-jobs", type=int, default=1, help="busy processes beside the 'busy' starts [1]")
    p.add_argument("--cases", default="cold,warm,cold-busy,warm-busy",
                   help="comma list: cold / warm, -busy beside --busy-jobs busy processes")
    p.add_argument("--settle", action="store_true",
                   help="after each start is ready, also wait for its costs to be measured in full (idle)")
    p.add_argument("--log", default="/tmp/serve_start.log")
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    results = {}
    for case in args.cases.split(","):
        if case.startswith("cold"):
            shutil.rmtree(os.path.join(args.home, "costs"), ignore_errors=True)
        load_before = round(os.getloadavg()[0], 2)
        results[case] = one_start(args, extra, busy=case.endswith("-busy")) | {"load_before": load_before}
        print(f"{case}: ready after {results[case]['ready_s']} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
