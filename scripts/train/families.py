"""The model families the trainer makes: shapes, training lengths, seeds, draft/target pairs.

Training ends on a step count (never a clock), so a rerun gives the same model up to GPU
nondeterminism. Every model is a Llama or Qwen3 with tied embeddings, trained on windows of
`seq` tokens sampled from the corpus stream (one Gemma 3 on request) (batch x seq tokens a step), AdamW with a linear
warm-up and a cosine decay to 10% of `lr`.
"""

from dataclasses import dataclass, field

LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Spec:
    name: str
    arch: str  # "llama" | "qwen3" | "gemma3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    steps: int
    lr: float
    seed: int
    batch: int = 16
    seq: int = 1024
    warmup: int = 100
    max_pos: int = 2048
    rms_eps: float = 1e-5
    # Distillation: the (already trained) model of the family whose next-token distribution
    # this one learns (forward KL at every position) instead of the corpus' next token.
    teacher: str | None = None
    # Gemma 3: the sliding layers' window (every sixth layer is full).
    window: int = 0
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})

    def params(self, vocab):
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norms = 4 if self.arch == "gemma3" else 2
        per_layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.inter + norms * self.hidden
        if self.arch in ("qwen3", "gemma3"):
            per_layer += 2 * self.head_dim
        return vocab * self.hidden + self.layers * per_layer + self.hidden


@dataclass(frozen=True)
class Family:
    name: str
    tokenizer: str  # "llama3" (the carried Llama 3 tokenizer.json) | "bpe" (trained here)
    vocab: int  # the BPE's size; for llama3 the tokenizer's
    models: tuple
    pairs: tuple  # (draft, target) names whose agreement is measured
    # Models trained only when --only names them (variants outside the family's time budget).
    extras: tuple = ()


CPU = Family(
    name="cpu",
    tokenizer="bpe",
    vocab=8192,
    models=(
        # Both with tokenizer and config take at most 24 MiB; each safetensors file under 16 MiB.
        Spec("harrier-cpu", "llama", hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, inter=768,
             steps=4000, lr=2e-3, seed=101, batch=32, seq=1024, warmup=200),
        Spec("harrier-cpu-draft", "llama", hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, inter=384,
             steps=3000, lr=3e-3, seed=102, batch=32, seq=1024, warmup=200),
    ),
    pairs=(("harrier-cpu-draft", "harrier-cpu"),),
)

GPU = Family(
    name="gpu",
    tokenizer="llama3",
    vocab=128256,
    models=(
        # The exact llama-3.2-1b shape: batch-1 decode is bandwidth-bound, so speculation can pay.
        Spec("trained-llama-1b", "llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, inter=8192,
             steps=430, lr=6e-4, seed=201, warmup=40, max_pos=131072, rope=LLAMA32_ROPE),
        Spec("trained-llama-174m", "llama", hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, inter=2048,
             steps=1000, lr=1.5e-3, seed=202, max_pos=131072, rope=LLAMA32_ROPE),
        # The shallow draft: 2 layers, so its step is far cheaper than the 1B target's.
        Spec("trained-draft-2l", "llama", hidden=1024, layers=2, heads=16, kv_heads=4, head_dim=64, inter=4096,
             steps=700, lr=2e-3, seed=203, max_pos=131072, rope=LLAMA32_ROPE),
        Spec("trained-draft-56m", "llama", hidden=384, layers=4, heads=6, kv_heads=2, head_dim=64, inter=1024,
             steps=700, lr=3e-3, seed=204, max_pos=131072, rope=LLAMA32_ROPE),
        Spec("trained-qwen3-155m", "qwen3", hidden=768, layers=8, heads=8, kv_heads=4, head_dim=128, inter=2048,
             steps=720, lr=1.5e-3, seed=205, max_pos=40960, rms_eps=1e-6,
             rope={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
    pairs=(("trained-draft-2l", "trained-llama-1b"), ("trained-draft-56m", "trained-llama-1b"),
           ("trained-draft-2l", "trained-llama-174m"), ("trained-draft-56m", "trained-llama-174m"),
           ("trained-draft-2l-distilled", "trained-llama-1b")),
    extras=(
        # The shallow draft distilled from the 1B target (its logits at every position of the
        # same windows): built for greedy agreement with that target. A teacher forward costs
        # about a third of the teacher's training step, so it is trained on request only.
        Spec("trained-draft-2l-distilled", "llama", hidden=1024, layers=2, heads=16, kv_heads=4, head_dim=64,
             inter=4096, steps=700, lr=2e-3, seed=206, max_pos=131072, rope=LLAMA32_ROPE,
             teacher="trained-llama-1b"),
        # A Gemma 3 (head_dim 256, 4 query heads to 1 KV head as the 1B; two full layers among
        # twelve) with a window of 128, so the held-out prompts (up to 256 tokens) cross it.
        Spec("trained-gemma3-150m", "gemma3", hidden=768, layers=12, heads=4, kv_heads=1, head_dim=256,
             inter=3072, steps=720, lr=1.5e-3, seed=207, max_pos=32768, rms_eps=1e-6, window=128,
             rope={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    ),
)

FAMILIES = {f.name: f for f in (CPU, GPU)}
