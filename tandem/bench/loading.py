"""The models and the environment a benchmark runs on (`tandem bench`, `tandem doctor`): loaded from the command
line's arguments, or random weights of real shapes (--synthetic-shape); where the numbers come from.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

import tandem
from tandem.api import default_draft
from tandem.backends.base import Model
from tandem.config import default_dtype

SYNTHETIC_CTX = 4096  # a synthetic model's context where --ctx gives none


def compute_dtype(args: argparse.Namespace) -> str:
    return args.dtype or default_dtype(args.device)


def synthetic_shapes(args: argparse.Namespace) -> dict[str, str] | None:
    spec = getattr(args, "synthetic_shape", None)
    if not spec:
        return None
    names = [s.strip() for s in spec.split(",")]
    if len(names) > 2 or not names[0]:
        raise ValueError(f"--synthetic-shape wants TARGET[,DRAFT], got {spec!r}")
    return {"target": names[0], **({"draft": names[1]} if len(names) == 2 and names[1] else {})}


def _check_synthetic_backend(args: argparse.Namespace) -> None:
    if args.backend == "llama.cpp":
        raise ValueError("--synthetic-shape builds torch models; use --backend torch (or auto)")


def load_target(args: argparse.Namespace) -> Model:
    shapes = synthetic_shapes(args)
    if shapes is not None:
        from tandem.synthetic.shapes import random_model

        _check_synthetic_backend(args)
        return random_model(shapes["target"], args.device, compute_dtype(args), n_ctx=args.ctx or SYNTHETIC_CTX, seed=0)
    return tandem.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                       n_ctx=args.ctx, progress=sys.stderr.isatty(),
                       isolation=getattr(args, "llamacpp_isolation", "auto"), threads=getattr(args, "threads", None))


def load_draft(args: argparse.Namespace, backend: str | None) -> Model | str | None:
    """The draft model, "ngram" or None; `backend` is the target's (None: as --backend says)."""
    device = getattr(args, "draft_device", None) or args.device
    shapes = synthetic_shapes(args)
    if shapes is not None:
        if "draft" not in shapes:
            return "ngram" if args.draft == "ngram" else None
        from tandem.synthetic.shapes import random_model

        _check_synthetic_backend(args)
        return random_model(shapes["draft"], device, compute_dtype(args), n_ctx=args.ctx or SYNTHETIC_CTX, seed=1)
    name = default_draft(args.model, args.draft, getattr(args, "no_draft", False))
    if name is None or name == "ngram":
        return name
    return tandem.load(name, device=device, dtype=args.dtype, backend=backend or args.backend,
                       n_ctx=args.ctx, progress=sys.stderr.isatty(),
                       isolation=getattr(args, "llamacpp_isolation", "auto"), threads=getattr(args, "threads", None))


def environment(target: Model) -> dict:
    """Where the numbers come from: hardware, software, commit, date."""
    device = target.device
    if device.startswith("cuda") and torch.cuda.is_available() and target.backend == "torch":
        device_name = torch.cuda.get_device_name(torch.device(device))
    elif target.backend == "llama.cpp" and not device.startswith("cpu"):
        # llama.cpp's own name for the device, with its memory kind (device-local, unified, host), as the model
        # (or its worker process, where llama.cpp may not load beside torch) found it.
        device_name = getattr(target, "device_description", None) or device
    else:
        device_name = cpu_model()
    return {
        "device": device, "device_name": device_name, "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
        "torch_version": torch.__version__, "tandem_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(tandem.__file__)),
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
