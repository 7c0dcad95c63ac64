"""Can this draft propose for this target? Only if token ids mean the same text in both (llama.cpp throws too)."""

from __future__ import annotations

from tandem.backends.base import Model

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
