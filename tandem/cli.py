"""`tandem generate | serve | bench | doctor | models`: one small function per subcommand behind one dispatcher."""

from __future__ import annotations

import argparse
import json
import sys

from tandem.config import BACKENDS, DEFAULT_BACKEND, DEFAULT_DEVICE, DRAFT_POLICIES, EngineConfig, ServerConfig
from tandem.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET


def add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_TARGET,
                   help=f"target: GGUF path or registry name [{DEFAULT_TARGET}]")
    if draft:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--draft", "-d", default=None,
                           help="draft: GGUF path (a draft model or a head draft, e.g. a Gemma 4 assistant), registry "
                           f"name, 'ngram', or 'auto' (the head beside the target's file) [{DEFAULT_DRAFT} with the "
                           "default target]")
        group.add_argument("--no-draft", action="store_true", help="plain decoding")
        p.add_argument("--draft-max", type=int, default=EngineConfig.draft_max,
                       help=f"most draft tokens per iteration [{EngineConfig.draft_max}]")
        p.add_argument("--draft-policy", choices=DRAFT_POLICIES, default=EngineConfig.draft_policy,
                       help="adaptive: pick k (or none) from measured costs; fixed: always --draft-max [adaptive]")
        p.add_argument("--draft-device", default=None, help="device of the draft [same as --device]")
        p.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false", default=None,
                       help="with a draft model, draft with it alone [adaptive: prompt lookup where it matches, "
                       "the draft model elsewhere]")
        p.add_argument("--recalibrate", action="store_true",
                       help="measure the pair's costs afresh instead of reusing those kept in $TANDEM_HOME/costs")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND,
                   help="auto: llama.cpp for quantised GGUF on CPU/Vulkan/Metal when installed, else torch (as "
                   f"tandem.load) [{DEFAULT_BACKEND}]")
    p.add_argument("--device", default=DEFAULT_DEVICE,
                   help=f"cpu, cuda, cuda:1, mps (torch); cpu, vulkan, metal (llama.cpp) [{DEFAULT_DEVICE}]")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads a forward runs on (llama.cpp's n_threads; torch's set_num_threads): fewer "
                   "than the cores leaves room for other work on a shared machine [llama.cpp: every physical core]")
    p.add_argument("--llamacpp-isolation", choices=["auto", "process", "none"], default="auto",
                   help="run llama.cpp in a worker process (process) or in this one (none); auto: a worker where a "
                   "CUDA build of llama.cpp would share the process with torch's CUDA [auto]")
    p.add_argument("--dtype", default=None,
                   help="torch compute dtype; with --backend auto it picks torch [float32 on cpu, bfloat16 on cuda]")
    p.add_argument("--ctx", type=int, default=None, help="context length in tokens [min(4096, trained)]")


def apply_recalibrate(args: argparse.Namespace) -> None:
    """--recalibrate: the calibration (tandem.engine.cost_store) reads it from the environment, as a user may
    set it."""
    if getattr(args, "recalibrate", False):
        import os

        from tandem.engine.cost_store import RECALIBRATE_ENV

        os.environ[RECALIBRATE_ENV] = "1"


def load_pair(args: argparse.Namespace):
    """(target, draft-or-'ngram'-or-None) as the command line asks."""
    from tandem.api import load_pair

    return load_pair(args.model, args.draft, getattr(args, "no_draft", False), args.device, args.dtype,
                     args.backend, args.ctx, getattr(args, "draft_device", None), progress=sys.stderr.isatty(),
                     isolation=getattr(args, "llamacpp_isolation", "auto"), threads=args.threads)


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _text_or_file(value: str) -> str:
    """`@path` reads the file; anything else is the text itself."""
    if value.startswith("@"):
        with open(value[1:]) as f:
            return f.read()
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    import tandem

    target, draft = load_pair(args)
    options = dict(
        draft=draft, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, draft_max=args.draft_max, draft_policy=args.draft_policy,
        stop=args.stop or None, n_ctx=args.ctx, prompt_lookup=args.prompt_lookup,
    )
    if args.json_schema is not None:
        options["json_schema"] = json.loads(_text_or_file(args.json_schema))
    elif args.json_object:
        options["response_format"] = {"type": "json_object"}
    elif args.grammar is not None:
        options["grammar"] = _text_or_file(args.grammar)
    if args.chat is not None:
        options["messages"] = [{"role": "user", "content": args.chat}]
    else:
        options["prompt"] = args.prompt
    if args.json:
        result = tandem.generate(target, **options)
        print(json.dumps({"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}, ensure_ascii=False))
        explain_no_drafts(target, result.stats)
        return 0
    final = None
    for chunk in tandem.stream_generate(target, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        final = chunk
    s = final.stats
    print(file=sys.stdout)
    print(f"[{final.finish_reason}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tokens/s; prefill "
          f"{s.prefill_ms:.0f} ms; drafted {s.draft_tokens}, accepted {s.accepted_tokens} "
          f"({100 * s.acceptance_rate:.0f}%); draft {s.draft_ms:.0f} ms, verify {s.verify_ms:.0f} ms in total",
          file=sys.stderr)
    if s.belief:
        believed = ", ".join(f"{k} {v:.2f}" for k, v in s.belief["acceptance"].items())
        print(f"policy: acceptance believed {believed}; predicted {s.belief['predicted_speedup']:.2f}x plain",
              file=sys.stderr)
    explain_no_drafts(target, s)
    return 0


def explain_no_drafts(target, stats) -> None:
    from tandem.api import why_no_drafts

    line = why_no_drafts(target, stats)
    if line:
        print(line, file=sys.stderr)


def cmd_models(args: argparse.Namespace) -> int:
    from tandem.loading import registry

    if args.action == "list":
        for m in registry.list_models():
            state = "pulled" if m.is_pulled else "not pulled"
            print(f"{m.name:32} {m.role:7} {m.bytes / 2**20:8.0f} MiB  {state:10}  {m.description}")
    elif args.action == "pull":
        print(registry.pull(args.name))
    elif args.action == "path":
        print(registry.path(args.name))
    elif args.action == "heads":
        from tandem.speculative.compat import heads_beside

        target = registry.resolve(args.target)
        found = heads_beside(target)
        for path, problems in found:
            print(f"{path}: " + ("fits" if not problems else "does not fit: " + "; ".join(problems)))
        if not found:
            print(f"no head draft beside {target} (tandem runs gemma4-assistant heads: docs/decisions/0004)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.server.serve import serve

    return serve(args)


def cmd_loadtest(args: argparse.Namespace) -> int:
    from tandem.bench.load import run_loadtest

    return run_loadtest(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from tandem.bench.bench import run_bench

    return run_bench(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from tandem.bench.doctor import run_doctor

    return run_doctor(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, speculatively when a draft is given")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt (no chat template)")
    src.add_argument("--chat", help="a user message, wrapped with the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [0]")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, tokens, stats")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="SCHEMA|@FILE", help="the output is JSON matching this schema")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--grammar", metavar="GBNF|@FILE", help="the output matches this GBNF (or Lark) grammar")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list, pull or locate the registry's models; the heads that fit a target")
    msub = m.add_subparsers(dest="action", required=True)
    msub.add_parser("list")
    for action in ("pull", "path"):
        a = msub.add_parser(action)
        a.add_argument("name")
    heads = msub.add_parser("heads", help="the head drafts beside a target's GGUF, and which of them fit it")
    heads.add_argument("target", help="the target: GGUF path or registry name")
    m.set_defaults(func=cmd_models)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-queue", type=int, default=ServerConfig.max_queue)
    s.add_argument("--slots", type=int, default=EngineConfig.slots,
                   help="requests decoded together at most (continuous batching)")
    s.add_argument("--kv-budget-mib", type=float, default=None,
                   help="KV memory for all slots' contexts, MiB (default: half the free memory); fewer slots fit less")
    s.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies get a 413 [4 MiB]")
    s.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the model id clients see; repeat it for aliases, which requests may name too [the --model "
                   "file's name without directory and .gguf]")
    s.add_argument("--accept-any-model", action="store_true",
                   help="answer requests naming any model instead of a 404 (replicas behind a gateway that counts "
                   "4xx against them: docs/deployment.md)")
    s.add_argument("--allowed-hosts", type=_comma_list, default=[], metavar="HOST[,HOST...]",
                   help="Host header values to accept besides loopback names; '*' accepts any [on a loopback bind: "
                   "loopback only; otherwise: any]")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin browsers may call from, e.g. http://localhost:3000 (repeatable) [CORS off]")
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout_s, metavar="SECONDS",
                   help="on SIGTERM, how long streams in flight may take to finish before they are cut [%(default)s]")
    s.set_defaults(func=cmd_serve)

    lt = sub.add_parser("loadtest", help="N concurrent streaming clients against a running server")
    lt.add_argument("--url", default="http://127.0.0.1:8080")
    lt.add_argument("--concurrency", "-c", type=int, default=4)
    lt.add_argument("--requests", "-n", type=int, default=16)
    lt.add_argument("--max-tokens", type=int, default=256)
    lt.add_argument("--prompt-kinds", default="code,freeform,json,summary")
    lt.add_argument("--temperature", type=float, default=0.0)
    lt.add_argument("--api-key", default=None)
    lt.add_argument("--model", default=None, help="model name to send [the server's first]")
    lt.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the results as JSON")
    lt.set_defaults(func=cmd_loadtest)

    b = sub.add_parser("bench", help="plain vs speculative side by side on a prompt suite")
    add_model_args(b)
    b.add_argument("--suite", default="default")
    b.add_argument("--max-tokens", type=int, default=256)
    b.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    b.add_argument("--plot", default=None, metavar="OUT.png")
    b.add_argument("--peer", action="append", default=[],
                   help="also run a peer: hf (transformers eager, plain and assisted), hf-static (static cache, "
                   "compiled on CUDA)")
    b.add_argument("--configs", default=None,
                   help="comma list: plain,adaptive (mixed: lookup and the draft),draft (the draft alone),fixed3,ngram")
    b.add_argument("--synthetic-acceptance", type=float, default=None, metavar="RATE",
                   help="accept each draft position with this probability (benchmarks only, not lossless)")
    b.add_argument("--synthetic-shape", default=None, metavar="TARGET[,DRAFT]",
                   help="random-weight models of named shapes instead of files, e.g. qwen2.5-32b,qwen2.5-1.5b")
    b.add_argument("--prompts", default=None, help="comma list of suite prompt names to run [all]")
    b.add_argument("--repeats", type=int, default=1,
                   help="timed rounds per prompt, configs interleaved; each config's median run is kept [1]")
    b.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("doctor", help="measure draft and verify costs on this device and explain them")
    add_model_args(d)
    d.add_argument("--json", action="store_true")
    d.add_argument("--synthetic-shape", default=None, metavar="TARGET[,DRAFT]",
                   help="random-weight models of named shapes instead of files, e.g. qwen2.5-32b,qwen2.5-1.5b")
    d.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement; medians reported [5]")
    d.add_argument("--slots", type=int, default=EngineConfig.slots,
                   help="also time batched forwards of 1, 2, 4, ... up to this many sequences (0: skip) [4]")
    d.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_recalibrate(args)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # our errors name the problem; no traceback for bad input
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
