"""Model configuration read from GGUF metadata.

One dataclass describes every decoder tandem runs; per-architecture quirks are fields, not subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "gemma3", "gemma4", "gemma4-assistant", "eagle3")
# Read and run by the llama.cpp backend only: the torch backend has no model for them (gemma4: per-layer head widths
# and KV head counts, values shared with keys, per-layer token embeddings, layers that reuse another layer's KV).
LLAMACPP_ONLY_ARCHITECTURES = ("gemma4", "gemma4-assistant", "eagle3")
# Head drafts: files that draft from a target's hidden states rather than run alone (docs/decisions/0004), by the
# target architecture each reads.
HEAD_ARCHITECTURES = {"gemma4-assistant": "gemma4", "eagle3": "llama"}

# How a model loads when nothing else is asked for: the defaults of `tandem.load`, the CLI and the server alike (a
# Python caller got torch in float32 where the CLI got llama.cpp, 15x slower in 4x the memory: issue 47).
BACKENDS = ("torch", "llama.cpp", "auto")
DEFAULT_BACKEND = "auto"  # llama.cpp for quantised GGUF off CUDA/MPS where it is installed, else torch (pick_backend)
DEFAULT_DEVICE = "cpu"


DRAFT_POLICIES = ("adaptive", "fixed")


@dataclass(frozen=True)
class EngineConfig:
    """How the batched engine runs: the defaults of `Engine`, `tandem.load/generate`, the CLI and the server alike."""

    slots: int = 4  # sequences decoded together at most: the KV pool holds a context for each
    draft_max: int = 8  # most draft tokens a sequence proposes an iteration; a request may ask for fewer
    draft_policy: str = "adaptive"  # "adaptive": draft lengths from measured costs; "fixed": always draft_max
    prompt_lookup: bool = True  # with a draft model, adaptive requests also draft by prompt lookup where text repeats
    prefill_chunk: int = 512  # prompt tokens prefilled a step across sequences: decoding streams keep flowing
    idle_prefill_chunks: int = 4  # prompt chunks a step takes while no sequence decodes (a burst of arrivals)
    kv_memory_fraction: float = 0.5  # the KV budget where none is given: this share of the device's free memory
    kv_budget_bytes: int | None = None  # KV memory for target and draft together; slots shrink to fit it
    n_ctx: int | None = None  # tokens a sequence may hold (None: the target's context)
    # plain steps a lone sequence queues a host sync (None: 8 where the device runs apart from the host, CUDA, else
    # 1: elsewhere steps computed past a stop token cost their full time)
    run_ahead: int | None = None

    def __post_init__(self) -> None:
        for name in ("slots", "prefill_chunk", "idle_prefill_chunks", "n_ctx", "run_ahead"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_max < 0:
            raise ValueError(f"draft_max must be >= 0, got {self.draft_max}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"unknown draft policy {self.draft_policy!r}; choose adaptive or fixed")


@dataclass(frozen=True)
class ServerConfig:
    """What a server admits and how it answers: the defaults of `create_app` and `tandem serve` alike."""

    model_name: str | None = None  # the id /v1/models lists and replies carry (None: the target file's name)
    aliases: tuple[str, ...] = ()  # other names requests may give the model (the file's path, served names)
    accept_any_model: bool = False  # any model name is this model: replicas behind a gateway (docs/deployment.md)
    api_key: str | None = None  # every route but /health and /metrics then needs it: probes carry no key
    # Host headers accepted besides loopback names and addresses (None: any), against DNS rebinding from a browser
    # (safety.allowed_hosts_for derives it from the bind address)
    allowed_hosts: frozenset[str] | None = frozenset()
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from (CORS); none unless asked for
    max_queue: int = 64  # requests that may wait for a slot; one more gets a 503 with Retry-After
    max_body_bytes: int = 4 * 2**20  # larger request bodies get a 413 without being read
    retry_after_s: int = 1  # what a 503 for a full queue asks the client to wait
    shutdown_timeout_s: float = 30.0  # a drain waits this long for running requests before it cuts them
    measure_at_start_s: float = 30.0  # a GPU's full cost measurement before the first request, at most


@dataclass(frozen=True)
class PolicyConfig:
    """The adaptive draft policy's tuning, each field with its why; the runs behind the figures are in
    docs/decisions/0005-cost-model.md (costs) and 0006-acceptance-policy.md (acceptance, budgets, reads)."""

    # Acceptance. Pseudo-counts (accepted, drafted) a fresh process starts from and every estimate drifts back to
    # while drafting is off: a = 0.7, what same-family pairs reach on code and JSON, held weakly (2 positions).
    acceptance_prior: tuple[float, float] = (1.4, 2.0)
    ngram_prior: tuple[float, float] = (0.5, 2.0)  # prompt lookup proposes often-wrong continuations ...
    long_match_prior: tuple[float, float] = (1.0, 2.0)  # ... less so after a match of its longest n-gram
    acceptance_decay: float = 0.9  # an estimate's evidence fades this much a drafting iteration ...
    idle_decay: float = 0.97  # ... and this much a plain one, back towards its prior
    # What acceptance a request may turn out to have is a Beta of the estimate's counts held as at least this many
    # positions (about one pair's spread across prompts); a weaker one bets on acceptances near 1 too often ...
    value_min_strength: float = 4.0
    # ... until completed requests show how much they differ: the Beta of their spread, at most this strong, once
    # prior_spread_requests are recorded (where requests accept alike, a weak Beta values drafting that never comes).
    value_max_strength: float = 64.0
    prior_spread_requests: int = 3
    prior_request_weight: float = 0.3  # weight of a completed request in the shared prior's acceptance
    prior_min_positions: int = 6  # a request that tried fewer draft positions says too little to move the prior
    prior_max_strength: float = 6.0  # pseudo-positions the learned prior is held with: requests differ
    default_reply_tokens: int = 128  # the reply length a fresh process expects (drafting's value is per token left)
    lookup_share_prior_tokens: int = 16  # a reply's lookup share counts this many more tokens: early hits weigh less
    default_copied_share: float = 0.2  # a reply's share a fresh process expects lookup to copy (then: learnt)
    beta_grid: int = 32  # points of the acceptance grid the expected value of drafting is integrated over
    value_grid: int = 16  # acceptance points value_of_drafting integrates over (a plan each)
    probe_budget: float = 0.03  # a re-probe's catch-up may cost at most this share of the plain time since the last
    # A request reads a draft its prior says will not pay once the requests that did not read it since the prior
    # last learned decoded plain for this share's worth of the read: else a prior learned low holds for good.
    explore_budget: float = 0.005
    probe_value_margin: float = 2.0  # a first catch-up is taken where the drafting it buys is worth this many times it
    # The draft takes in a prompt beside the target's prefill only where the chance that drafting gains nothing is
    # at most this; elsewhere its first read takes the prompt in, where that read is judged worth it.
    prefill_max_risk: float = 0.2
    # Reads. Generated tokens to wait for before that first catch-up: the draft reads them teacher-forced, and how
    # many it would have predicted is this request's acceptance, measured before a single draft is verified.
    evidence_tokens: int = 6
    evidence_rows: int = 16  # an evidence read reads the draft's predictions of at most this many latest tokens
    learning_iterations: int = 4  # drafting iterations a policy without that evidence spends learning a draft is poor
    steady_catch_up: int = 2  # a draft that catches up on at most this many tokens is drafting steadily
    # An adaptive draft ends after a token the draft gave less than this probability (greedy: its top token's;
    # sampled: its distribution's largest): its next ones are unlikely to pass (llama.cpp's p_min, 0.75; 0.5 stopped
    # too late on every prompt of docs/decisions/0009). 0: drafts run to the planned k.
    draft_confidence: float = 0.75
    replan_plain: int = 8  # steps a plain plan stands while no sequence becomes hopeful (DraftPolicy.plan)
    # The drafting floors (DraftPolicy._floor): bisected to this precision, from an acceptance of floor_top down,
    # and kept floor_steps steps before they are bisected again from the costs as learned by then.
    floor_precision: float = 1.0 / 32
    floor_top: float = 0.99
    floor_steps: int = 256
    values_kept: int = 4096  # values of drafting kept at most before the stale ones are dropped
    # Learning the costs. A cost the loop observes is the median of its latest observed_window timings: a one-off
    # (a shape's first use: graph capture, a pipeline built) moves no estimate.
    observed_window: int = 5
    overrun_memory: int = 256  # plain steps of a batch size after which a drafting overrun not seen since is forgotten
    # A step's time runs to the next step's start while sequences keep running (a server's streams are served in the
    # gap); a longer gap is a pause (a collection, a debugger), not the loop's work, and is left out.
    step_gap_max_ms: float = 50.0
    ewma_weight: float = 0.2  # weight of a new figure in the running estimates of runs and catch-ups
    # Costs paid once a run (a draft's catch-up, a change of shape) are spread over the iterations such runs have
    # lasted (EWMAs within run_limits): catch_up_iterations and switch_iterations before any run is seen.
    catch_up_iterations: int = 16
    switch_iterations: int = 8
    run_limits: tuple[float, float] = (1.0, 16.0)
    # Feeding the last drafts beside the verify replaces the catch-up forward of a sequence whose drafts all pass,
    # about half the steps (a = 0.8, k = 3: 0.51): it pays where it adds less than this share of a draft step.
    ahead_pays: float = 0.5
    yield_decay: float = 0.99  # drafting's yield against its plans: a step weighs this times the one after ...
    yield_prior: float = 32.0  # ... and this many tokens expected and yielded alike at first


POLICY = PolicyConfig()  # the policy's tuning (one process, one policy)


def default_dtype(device: str) -> str:
    """The torch backend's compute dtype where none is asked for: bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # GGUF `general.architecture`: qwen2 | llama | gemma3 | gemma4 | gemma4-assistant (a head)
    vocab_size: int  # rows of token_embd
    n_layers: int
    d_model: int  # embedding width
    d_ffn: int  # feed-forward hidden width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA when < n_heads)
    head_dim: int  # per-head width (gemma3 sets it apart from d_model / n_heads; gemma4: the sliding layers')
    context_length: int  # trained context; the cache may be smaller
    rms_eps: float
    rope_base: float
    rope_interleaved: bool = False  # llama.cpp's "normal" rope (pairs 2i, 2i+1), `llama`; qwen2/gemma3 rotate halves
    rope_scale: float = 1.0  # linear position scaling (positions divided by this)
    rope_base_local: float | None = None  # gemma3: sliding-window layers use their own base
    sliding_window: int | None = None  # gemma3: window of the local layers
    sliding_window_pattern: int = 0  # gemma3: every Nth layer is global, the rest local (0 = all global)
    sliding_layers: tuple[bool, ...] = ()  # gemma4: per layer, True = sliding window (overrides the pattern)
    global_head_dim: int | None = None  # gemma4: head width of the full-attention layers
    head_input_width: int | None = None  # a head draft (gemma4-assistant, eagle3): the target hidden width it reads
    head_target_layers: tuple[int, ...] = ()  # eagle3: the target layers whose inputs it fuses
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim)
    embed_scale: float = 1.0  # gemma multiplies embeddings by sqrt(d_model)
    activation: str = "silu"  # silu (SwiGLU) or gelu_tanh (GeGLU)
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # gemma3: RMSNorm on each query/key head
    sandwich_norm: bool = False  # gemma3: extra norms after attention and after the FFN
    tied_embeddings: bool = False  # no output.weight in the file: reuse token_embd
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    def is_local_layer(self, layer: int) -> bool:
        """True for a sliding-window layer (gemma3 alternates 5 local : 1 global)."""
        if self.sliding_layers:
            return self.sliding_layers[layer]
        if not self.sliding_window or self.sliding_window_pattern <= 0:
            return False
        return (layer + 1) % self.sliding_window_pattern != 0


class HeadMismatchError(ValueError):
    """A head draft was trained on another target: another architecture, hidden size or vocabulary."""


def head_problems(target_config, head_config) -> list[str]:
    """Why a head (its ModelConfig) cannot draft for a target (its ModelConfig); [] where it can."""
    wanted = HEAD_ARCHITECTURES[head_config.architecture]
    problems = []
    if target_config.architecture != wanted:
        problems.append(f"a {head_config.architecture} head drafts for {wanted} targets, not "
                        f"{target_config.architecture}")
    if head_config.head_input_width != target_config.d_model:
        problems.append(f"it reads hidden states of {head_config.head_input_width} values, the target's are "
                        f"{target_config.d_model}")
    if head_config.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary of {head_config.vocab_size} tokens, the target's {target_config.vocab_size}")
    if head_config.architecture == "eagle3":  # its own KV; the layers it reads must exist
        if any(not 0 <= layer < target_config.n_layers for layer in head_config.head_target_layers):
            problems.append(f"it reads target layers {list(head_config.head_target_layers)}, the target has "
                            f"{target_config.n_layers}")
    elif (head_config.head_dim, head_config.global_head_dim) != (target_config.head_dim,
                                                                  target_config.global_head_dim):
        problems.append(f"head widths {head_config.head_dim}/{head_config.global_head_dim} (sliding/full), the "
                        f"target's KV {target_config.head_dim}/{target_config.global_head_dim}")
    return problems
