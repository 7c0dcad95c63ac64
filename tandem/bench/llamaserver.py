"""llama.cpp's own llama-server as a peer: plain vs `--spec-type draft-simple` on the bench suite, side by side.

    python -m tandem.bench.llamaserver --server /path/to/llama-server --model T.gguf --draft D.gguf \
        --n-max 3,8 [--ngl 99] [--max-tokens 256] [--json OUT]

Starts the server once per configuration on a free loopback port, sends the suite through the chat-completions API
(greedy, as the original report did) and reads llama-server's own `timings` (predicted_per_second, draft_n,
draft_n_accepted). llama.cpp is not built by tandem; build it from its sources (see docs) and point --server at it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx

from tandem.bench.suite import load_suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(server: str, model: str, draft: str | None, n_max: int, ngl: int, threads: int | None, ctx: int,
            slots: int = 1, extra: Sequence[str] = ()) -> Iterator[str]:
    """llama-server on a free loopback port, plain or with `draft` (classic draft-model speculation, at most n_max
    tokens an iteration), `slots` parallel sequences of `ctx` tokens each; yields its base URL once healthy."""
    with server_process(server, model, draft, n_max, ngl, threads, ctx, slots, extra) as (_, base):
        yield base


@contextlib.contextmanager
def server_process(server: str, model: str, draft: str | None, n_max: int, ngl: int, threads: int | None, ctx: int,
                   slots: int = 1, extra: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen, str]]:
    """As `serving`, yielding the process too (its pid: CPU-time measurements)."""
    port = free_port()
    cmd = [server, "-m", model, "--port", str(port), "--host", "127.0.0.1", "-ngl", str(ngl), "-c", str(ctx * slots),
           "-np", str(slots), "--no-webui", *extra]
    if threads:
        cmd += ["-t", str(threads)]
    if draft:
        # Passing only -md drafts nothing in current builds: the type is inferred from the draft's metadata (MTP,
        # DFlash, ...), none for a plain model; `draft-simple` is the classic draft-model speculation.
        cmd += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max),
                "--spec-draft-ngl", str(ngl)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not become healthy in 10 minutes")
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_config(server: str, model: str, draft: str | None, n_max: int, ngl: int, threads: int | None,
               prompts, max_tokens: int, ctx: int) -> dict:
    with serving(server, model, draft, n_max, ngl, threads, ctx) as base:
        rows = []
        for prompt in prompts:
            body = {"messages": list(prompt.messages), "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
            httpx.post(base + "/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=600)  # warm-up
            reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=600).json()
            t = reply.get("timings", {})
            drafted = t.get("draft_n", 0) or 0
            rows.append({
                "name": prompt.name, "tps": t.get("predicted_per_second"), "predicted_n": t.get("predicted_n"),
                "draft_n": drafted, "draft_n_accepted": t.get("draft_n_accepted", 0),
                "acceptance_rate": (t.get("draft_n_accepted", 0) / drafted) if drafted else None,
                "text": reply["choices"][0]["message"]["content"],
            })
        return {"draft": bool(draft), "n_max": n_max if draft else 0, "prompts": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--n-max", default="3,8", help="comma list of --spec-draft-n-max values")
    p.add_argument("--ngl", type=int, default=0, help="GPU layers (99 = all)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = [pr for pr in load_suite("default") if pr.kind != "edit"] + [
        pr for pr in load_suite("default") if pr.kind == "edit"]
    configs = [run_config(args.server, args.model, None, 0, args.ngl, args.threads, prompts, args.max_tokens,
                          args.ctx)]
    for n in (int(x) for x in args.n_max.split(",")):
        configs.append(run_config(args.server, args.model, args.draft, n, args.ngl, args.threads, prompts,
                                  args.max_tokens, args.ctx))
    plain = {r["name"]: r for r in configs[0]["prompts"]}
    print(f"{'prompt':10} {'plain t/s':>10} " + " ".join(f"{'n-max ' + str(c['n_max']):>22}" for c in configs[1:]))
    for name, row in plain.items():
        cells = []
        for c in configs[1:]:
            r = next(x for x in c["prompts"] if x["name"] == name)
            same = "=" if r["text"] == row["text"] else "≠"
            acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
            cells.append(f"{r['tps']:7.1f} ({r['tps'] / row['tps']:.2f}x a{acc}{same})")
        print(f"{name:10} {row['tps']:10.1f} " + " ".join(f"{c:>22}" for c in cells))
    print("(= / ≠: greedy text with the draft equals / differs from llama-server's own plain text)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peer": "llama-server", "server": args.server, "ngl": args.ngl, "configs": configs}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
