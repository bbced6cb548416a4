"""dsaserve against the transformers reference (float32, generated checkpoints).

Each variant compares, in this order: the resolved indexer schedule, the top-k sets of every full
layer, per-position log-probabilities (1e-4), and a 32-token greedy continuation decoded from the
paged cache. Prompts are ≥ 4 × index_topk long so the indexer really prunes.
"""

import pytest
import torch
from reference import (
    dsaserve_forward,
    first_topk_mismatch,
    indexer_margin,
    load_reference,
    reference_forward,
    reference_greedy,
)

from dsaserve import LLM, SamplingParams
from dsaserve.config import ModelConfig
from dsaserve.model.mla import MLAAttention

INDEX_TOPK = 16
PROMPT_LEN = 77  # ≥ 4 × index_topk, not a multiple of the block size
MIN_MARGIN = 1e-5  # relative gap at the top-k boundary; well above float32 noise (~1e-6)

VARIANTS = {
    "mixed_FFSS": {},
    "all_full": dict(indexer_types=["full"] * 4),
    "pattern_only": dict(indexer_types=None, index_topk_pattern="FSFS"),
    "freq_offset_only": dict(indexer_types=None, index_topk_freq=3, index_skip_topk_offset=1),
    "expert_groups": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
    "dense_prefix_0": dict(first_k_dense_replace=0),
    "dense_prefix_2": dict(first_k_dense_replace=2),
}
EXPECTED_PATTERNS = {"pattern_only": "FSFS", "freq_offset_only": "FSSF", "all_full": "FFFF"}


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(30, vocab, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def variant(request, make_checkpoint):
    name = request.param
    path = make_checkpoint(f"parity_{name}", seed=0, **VARIANTS[name])
    ref = load_reference(path)
    return name, path, ref


def assert_matches_reference(path, ref, ids, **forward_args):
    margin = indexer_margin(ref, ids)
    assert margin > MIN_MARGIN, f"fixture has near-tied indexer scores (margin {margin:.1e}); pick another seed"
    expected = reference_forward(ref, ids)
    ours = dsaserve_forward(path, ids, **forward_args)
    mismatch = first_topk_mismatch(ours, expected)
    assert mismatch is None, mismatch
    diff = (ours.logprobs - expected.logprobs).abs().max().item()
    assert diff < 1e-4, f"log-probabilities differ by {diff:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_prefill_matches_reference(variant):
    name, path, ref = variant
    cfg = ModelConfig.from_pretrained(path)
    assert list(ref.config.indexer_types) == list(cfg.indexer_types)
    if name in EXPECTED_PATTERNS:
        assert cfg.indexer_schedule.pattern == EXPECTED_PATTERNS[name]
    assert cfg.index_topk == INDEX_TOPK and PROMPT_LEN >= 4 * INDEX_TOPK
    assert_matches_reference(path, ref, prompt(cfg.vocab_size, PROMPT_LEN, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_greedy_decode_from_paged_cache_matches_reference(variant):
    name, path, ref = variant
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=2)
    llm = LLM(path, dtype="float32", block_size=16, progress=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, ids, 32)


@pytest.mark.parametrize("variant", ["mixed_FFSS"], indirect=True)
@pytest.mark.parametrize("max_num_batched_tokens", [8192, 13])
def test_batch_of_different_lengths_equals_each_alone(variant, max_num_batched_tokens):
    """Four requests in one flattened batch (and, with a 13-token budget, prefilled in chunks smaller
    than index_topk and not multiples of the block size) equal their single-request results."""
    _, path, ref = variant
    vocab = ref.config.vocab_size
    # The 10-token prompt starts inside index_topk (everything selected, no scoring) and grows past it.
    prompts = [prompt(vocab, n, seed=10 + n) for n in (70, PROMPT_LEN, 90, 10)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=max_num_batched_tokens, progress=False)
    together = [o.outputs[0].token_ids
                for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    alone = [llm.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    assert together == alone
    assert together[0] == reference_greedy(ref, prompts[0], 16)
    assert together[3] == reference_greedy(ref, prompts[3], 16)


def test_dense_backend_equals_reference_when_topk_covers_everything(make_checkpoint):
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    ref = load_reference(path, index_topk=4096)  # every causal token selected
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=3)
    expected = reference_forward(ref, ids)
    ours = dsaserve_forward(path, ids, attention_backend="dense")
    assert ours.topk == {}  # the dense backend skips the indexer
    assert (ours.logprobs - expected.logprobs).abs().max().item() < 1e-4
    llm = LLM(path, dtype="float32", block_size=16, attention_backend="dense", progress=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, ids, 16)


# ---- the parity checks notice broken code -------------------------------------------------------


def test_parity_check_fails_without_indexer_causal_mask(make_checkpoint, monkeypatch):
    import dsaserve.attention.indexer_selection as indexer

    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    ref = load_reference(path)
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=1)
    monkeypatch.setattr(indexer, "invisible", lambda key_pos, query_pos: torch.zeros(
        len(query_pos), len(key_pos), dtype=torch.bool))
    with pytest.raises(AssertionError, match="layer 0 position"):
        assert_matches_reference(path, ref, ids)


def test_parity_check_fails_when_shared_layer_reuses_wrong_topk(make_checkpoint, monkeypatch):
    """With schedule FSFS, layer 3 must reuse layer 2's top-k; hand it layer 0's instead."""
    path = make_checkpoint("parity_pattern_only", seed=0, **VARIANTS["pattern_only"])
    ref = load_reference(path)
    ids = prompt(ref.config.vocab_size, PROMPT_LEN, seed=1)
    first = {}
    original = MLAAttention.forward

    def reuse_first(self, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer=True):
        if self.indexer is None and "topk" in first:
            prev_topk = first["topk"]
        out, topk = original(self, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer)
        first.setdefault("topk", topk)
        return out, topk

    monkeypatch.setattr(MLAAttention, "forward", reuse_first)
    with pytest.raises(AssertionError):
        assert_matches_reference(path, ref, ids)
    ours, expected = dsaserve_forward(path, ids), reference_forward(ref, ids)
    assert (ours.logprobs - expected.logprobs).abs().max().item() > 1e-3
