"""Qwen3 dense shapes (shared seed-notes) and the tiny test shape."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB = 151936  # Qwen3's padded vocabulary (151643 BPE tokens + specials + padding)


@dataclass(frozen=True)
class Qwen3Shape:
    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    tied: bool
    head_dim: int = 128
    max_positions: int = 40960

    def linears(self) -> dict[str, tuple[int, int]]:
        """(N, K) of one decoder layer's linears as vLLM merges them."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def linear_params(self) -> int:
        return self.layers * sum(n * k for n, k in self.linears().values())

    def config_json(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": self.head_dim, "hidden_act": "silu", "hidden_size": self.hidden,
            "initializer_range": 0.02, "intermediate_size": self.intermediate,
            "max_position_embeddings": self.max_positions, "max_window_layers": self.layers,
            "num_attention_heads": self.q_heads, "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads, "rms_norm_eps": 1e-6, "rope_scaling": None,
            "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            "vocab_size": VOCAB,
        }


SHAPES: dict[str, Qwen3Shape] = {
    # Small enough for a test engine to start in seconds; untied so greedy output
    # depends on the input instead of echoing the last token.
    "tiny": Qwen3Shape(hidden=256, intermediate=768, layers=2, q_heads=4, kv_heads=2, tied=False,
                       max_positions=4096),
    "0.6B": Qwen3Shape(1024, 3072, 28, 16, 8, tied=True),
    "1.7B": Qwen3Shape(2048, 6144, 28, 16, 8, tied=True),
    "4B": Qwen3Shape(2560, 9728, 36, 32, 8, tied=True),
    "8B": Qwen3Shape(4096, 12288, 36, 32, 8, tied=False),
    "14B": Qwen3Shape(5120, 17408, 40, 40, 8, tied=False),
    "32B": Qwen3Shape(5120, 25600, 64, 64, 8, tied=False),
}
