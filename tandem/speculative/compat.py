"""Can this draft propose for this target? Only if token ids mean the same text in both (llama.cpp throws too)."""

from __future__ import annotations

from tandem.backends.base import Model
from tandem.config import HEAD_ARCHITECTURES, HeadMismatchError, head_problems

PROBE_TEXT = "def main():\n    print('héllo, wörld') # 123 {\"json\": [1, 2]} <|im_start|>user\n"


class VocabularyMismatchError(ValueError):
    """The draft's tokenizer differs from the target's."""


def draft_ids(tokens: list[int], draft_vocab: int) -> list[int]:
    """Token ids as a draft can take them in. A target with a wider (padded) vocabulary may emit an id the draft has
    no embedding for (Qwen2.5-32B has 152064 rows, its 0.5B-3B drafts 151936; a random 32B emits one every ~1200
    tokens): the draft gets a stand-in (0). Its proposals after it may be worse; the target verifies every one."""
    if all(t < draft_vocab for t in tokens):
        return tokens
    return [t if t < draft_vocab else 0 for t in tokens]


def check_compatible(target: Model, draft: Model) -> None:
    t, d = target.tokenizer, draft.tokenizer
    problems = []
    if abs(t.vocab_size - d.vocab_size) > 128:
        problems.append(f"vocabulary sizes {t.vocab_size} (target) vs {d.vocab_size} (draft)")
    if tuple(t.eos_token_ids) != tuple(d.eos_token_ids):
        problems.append(f"end-of-sequence ids {tuple(t.eos_token_ids)} vs {tuple(d.eos_token_ids)}")
    target_ids, draft_ids = t.encode(PROBE_TEXT), d.encode(PROBE_TEXT)
    if target_ids != draft_ids:
        problems.append(f"a probe text tokenizes differently ({len(target_ids)} vs {len(draft_ids)} tokens)")
    if problems:
        raise VocabularyMismatchError(
            f"draft {draft.path!r} cannot draft for target {target.path!r}: " + "; ".join(problems)
        )


def is_head(model: Model) -> bool:
    """Whether a model is a head draft (it drafts from a target's hidden states and cannot run alone)."""
    return getattr(model.config, "architecture", None) in HEAD_ARCHITECTURES


def check_head(target: Model, head: Model) -> None:
    """Raise HeadMismatchError unless `head` drafts for `target` (and their tokenizers agree: check_compatible)."""
    problems = head_problems(target.config, head.config)
    if problems:
        raise HeadMismatchError(f"head {head.path!r} cannot draft for target {target.path!r}: " + "; ".join(problems))
    check_compatible(target, head)


def heads_beside(target_path: str) -> list[tuple[str, list[str]]]:
    """The head drafts (GGUF files of a head architecture) in the target file's folder, each with why it cannot
    draft for that target ([] where it can): `--draft auto`, `tandem models heads`."""
    import os

    from tandem.loading.gguf import GGUFError, open_gguf

    target = open_gguf(target_path).config
    folder = os.path.dirname(os.path.abspath(target_path))
    found = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".gguf") or os.path.samefile(path, target_path):
            continue
        try:
            gguf = open_gguf(path)
            if gguf.architecture in HEAD_ARCHITECTURES:
                found.append((path, head_problems(target, gguf.config)))
        except GGUFError:
            continue  # not a file tandem reads: not a head either
    return found


def find_head(target_path: str) -> str:
    """`--draft auto`: the head draft beside the target's GGUF that fits it; a ValueError saying what was found
    otherwise. (A head inside the target's file, Qwen3.5's nextn layer, is not run by tandem yet.)"""
    found = heads_beside(target_path)
    fitting = [path for path, problems in found if not problems]
    if fitting:
        return fitting[0]
    why = "; ".join(f"{path}: {', '.join(problems)}" for path, problems in found) or "none found"
    raise ValueError(f"--draft auto: no head draft for {target_path!r} beside it ({why}); put its assistant GGUF "
                     "(e.g. a Gemma 4 *-assistant file) in the same folder, or give --draft a path")
