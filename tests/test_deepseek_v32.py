"""DeepSeek-V3.2 (`deepseek_v32`) against transformers' DeepseekV32ForCausalLM (float32, generated checkpoints).

The checkpoint is the GLM fixtures' geometry as DeepSeek-V3.2 lays it out: every layer runs its own indexer (no
IndexShare), half-split RoPE in the indexer, YaRN RoPE (mscale as DeepSeek ships it), and grouped routing (16
experts in 4 groups, the top 2 groups chosen). Prompts are ≥ 4 × index_topk so the indexer prunes.
"""

import pytest
from reference import (
    dsaserve_forward,
    first_topk_mismatch,
    indexer_margin,
    load_reference,
    reference_forward,
    reference_greedy,
)
from test_parity import prompt
from test_speculative import make_llm as make_spec_llm
from test_speculative import oracle_drafts, token_ids

from dsaserve import LLM, SamplingParams
from dsaserve.config import ConfigError, ModelConfig

INDEX_TOPK = 16
PROMPT_LEN = 77  # ≥ 4 × index_topk, not a multiple of the block size
V32 = dict(model_type="deepseek_v32", n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint("deepseek_v32", seed=0, **V32)


@pytest.fixture(scope="module")
def ref(path):
    return load_reference(path)


def make_llm(path, **kwargs) -> LLM:
    return LLM(path, **{**dict(dtype="float32", block_size=16, max_model_len=512, progress=False), **kwargs})


def alone(path, ids, params=GREEDY) -> list[int]:
    llm = make_llm(path, enable_prefix_caching=False)
    return llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids


def test_config_fields_left_out_take_the_references_defaults():
    from transformers import DeepseekV32Config

    cfg = ModelConfig.from_dict({"model_type": "deepseek_v32"})
    expected = DeepseekV32Config()
    for name in ("index_n_heads", "index_head_dim", "index_topk", "n_group", "topk_group", "rms_norm_eps",
                 "num_hidden_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor",
                 "max_position_embeddings", "vocab_size", "hidden_size"):
        assert getattr(cfg, name) == getattr(expected, name), name
    assert cfg.rope.theta == expected.rope_parameters["rope_theta"]
    assert cfg.mlp_layer_types == tuple(expected.mlp_layer_types)
    assert cfg.indexer_schedule.pattern == "F" * 61
    assert not cfg.indexer_rope_interleave and cfg.rope_interleave  # half-split indexer, interleaved MLA


def test_a_schedule_field_that_shares_layers_is_refused():
    with pytest.raises(ConfigError, match="deepseek_v32 runs its own indexer on every layer"):
        ModelConfig.from_dict({"model_type": "deepseek_v32", "num_hidden_layers": 4, "index_topk_pattern": "FSFS"})


def test_prefill_matches_reference(path, ref):
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.indexer_schedule.pattern == "FFFF" and cfg.n_group == 4 and cfg.rope.rope_type == "yarn"
    ids = prompt(cfg.vocab_size, PROMPT_LEN, seed=1)
    margin = indexer_margin(ref, ids)
    assert margin > 1e-5, f"fixture has near-tied indexer scores (margin {margin:.1e})"
    expected = reference_forward(ref, ids)
    ours = dsaserve_forward(path, ids)
    assert sorted(ours.topk) == [0, 1, 2, 3]  # every layer selected its own top-k
    mismatch = first_topk_mismatch(ours, expected)
    assert mismatch is None, mismatch
    diff = (ours.logprobs - expected.logprobs).abs().max().item()
    assert diff < 1e-4, f"log-probabilities differ by {diff:.2e}"


def test_the_parity_check_sees_the_indexers_rope_layout(path, ref):
    """GLM's interleaved indexer RoPE on a DeepSeek-V3.2 checkpoint selects other tokens."""
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=1)
    ours = dsaserve_forward(path, ids, hf_overrides={"indexer_rope_interleave": True})
    assert first_topk_mismatch(ours, reference_forward(ref, ids)) is not None


def test_greedy_decode_from_paged_cache_matches_reference(path, ref):
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = make_llm(path).generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, ids, 32)


def test_chunked_prefill_and_batching_equal_each_request_alone(path, ref):
    """7-token chunks (smaller than index_topk, not block-aligned), four requests of different lengths together."""
    vocab = ref.config.vocab_size
    prompts = [prompt(vocab, n, seed=10 + n) for n in (70, PROMPT_LEN, 90, 10)]
    llm = make_llm(path, max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                              use_tqdm=False)]
    assert together == [alone(path, p) for p in prompts]
    assert together[1] == reference_greedy(ref, prompts[1], 12)


@pytest.mark.parametrize("shared_len", [64, 70])  # ends on a block boundary / mid-block
def test_prefix_cache_hit_equals_running_alone(path, ref, shared_len):
    vocab = ref.config.vocab_size
    shared = prompt(vocab, shared_len, seed=20)
    first, second = shared + prompt(vocab, 13, seed=21), shared + prompt(vocab, 19, seed=22)
    llm = make_llm(path)
    llm.generate(prompt_token_ids=first, sampling_params=GREEDY, use_tqdm=False)
    out = llm.generate(prompt_token_ids=second, sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.metrics["num_prefix_hit_tokens"] == 64
    assert out.outputs[0].token_ids == alone(path, second) == reference_greedy(ref, second, 12)


def test_mtp_speculation_keeps_greedy_output(make_checkpoint, monkeypatch):
    """The MTP layer (model.layers.{num_hidden_layers}, with its own indexer) drafts through the speculative
    path; with drafts that are mostly right, whole rounds are accepted and the output is unchanged."""
    checkpoint = make_checkpoint("deepseek_v32_mtp", seed=3, include_mtp=True, **V32)
    prompts = [{"prompt_token_ids": [9 + (5 * i) % 250 for i in range(n)]} for n in (20, 70)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = token_ids(make_spec_llm(checkpoint), prompts, params)
    plain = make_spec_llm(checkpoint, 2)
    assert token_ids(plain, prompts, params) == expected  # the MTP layer's own drafts
    llm = make_spec_llm(checkpoint, 2)
    truth = {tuple(p["prompt_token_ids"]): out[0] for p, out in zip(prompts, expected)}
    oracle_drafts(monkeypatch, llm.engine.runner, lambda rid, state: truth[tuple(state.prompt_token_ids)])
    assert token_ids(llm, prompts, params) == expected
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
