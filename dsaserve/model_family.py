"""The model families dsaserve serves, and what differs between them beyond config.json's own fields.

Every family is MLA + lightning indexer + top-k sparse attention + MoE with the same checkpoint layout; they
differ in which layers run an indexer (IndexShare or every layer), in the defaults their transformers
reference assumes for fields a config.json leaves out, and in their chat format and output parsers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    name: str  # in messages and logs
    architecture: str  # the transformers class that is the numerical oracle
    index_share: bool  # schedule fields may make layers shared; else every layer runs its own indexer
    reasoning_parser: str  # the server's default --reasoning-parser
    tool_call_parser: str  # the server's default --tool-call-parser
    chat_encoding: str | None = None  # a built-in chat encoding, used when the checkpoint ships no template
    defaults: dict = field(default_factory=dict)  # config.json fields the reference assumes when absent


GLM_MOE_DSA = ModelFamily("glm_moe_dsa", "GLM-5.x", "GlmMoeDsaForCausalLM", index_share=True,
                          reasoning_parser="glm45", tool_call_parser="glm47")

# transformers' DeepseekV32Config defaults (models/deepseek_v32), plus the layouts its modeling code fixes:
# half-split RoPE in the indexer, interleaved pairs in the main attention.
DEEPSEEK_V32 = ModelFamily(
    "deepseek_v32", "DeepSeek-V3.2", "DeepseekV32ForCausalLM", index_share=False,
    reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v32", chat_encoding="deepseek_v32",
    defaults={
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64, "first_k_dense_replace": 3,
        "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False, "tie_word_embeddings": False,
        "indexer_rope_interleave": False, "rope_interleave": True,
    },
)

# transformers' Glm5NextTextConfig defaults (models/glm5_next). NoPE attention: there is no RoPE anywhere in the text
# model, so rope_theta only fills the field; the first three layers are dense as its mlp_layer_types default says.
GLM5_NEXT = ModelFamily(
    "glm5_next", "GLM-5.3-Flash", "Glm5NextForConditionalGeneration", index_share=True,
    reasoning_parser="glm45", tool_call_parser="glm47",
    defaults={
        "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 45, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 288,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0,
        "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3,
        "attention_bias": False, "tie_word_embeddings": False, "pad_token_id": 154820,
    },
)

FAMILIES = {f.model_type: f for f in (GLM_MOE_DSA, DEEPSEEK_V32, GLM5_NEXT)}
