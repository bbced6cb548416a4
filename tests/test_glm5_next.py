"""GLM-5.3-Flash (`glm5_next`) against transformers' Glm5NextForConditionalGeneration (float32, generated checkpoints).

The checkpoint (demo/checkpoint_builder.py) mixes KDA and indexed-attention layers (K A A K K A, the second indexed
layer shared), NoPE MLA, pools of 4 tokens with index_topk 16 (4 pools kept), 4 mHC streams and a SwiGLU clamp low
enough to bite. Prompts are ≥ 4 × index_topk so the pooled indexer prunes. Each test compares, in this order: the
selected positions of every full layer (pools and tail), per-position log-probabilities (1e-4), greedy tokens.
"""

import json
import logging
import os
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from reference import load_reference, reference_greedy
from test_parity import prompt
from test_quantization import assert_same_outputs, twin_of

from dsaserve import LLM, SamplingParams
from dsaserve.attention.linear_state import LinearStateCache
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ConfigError, ModelConfig
from dsaserve.engine import llm_engine
from dsaserve.engine.scheduling.cache_plan import DEFAULT_STATE_SHARE
from dsaserve.engine.workers.kv_cache import KVCache
from dsaserve.model import load_model
from dsaserve.native import torch_ops
from dsaserve.quantization.formats import QUANTIZATION_MODES
from dsaserve.quantization.quantized_weight import QuantizedWeight

INDEX_TOPK, KPOOL = 16, 4
PROMPT_LEN = 77  # ≥ 4 × index_topk, not a multiple of the pool or the block
MIN_MARGIN = 1e-5  # relative gap between the kept and the first dropped pool's score
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FLASH_CONFIG = os.path.join(os.path.dirname(__file__), "data", "glm-5.3-flash-config.json")


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint("glm5_next", seed=0, model_type="glm5_next")


@pytest.fixture(scope="module")
def ref(path):
    return load_reference(path)


def make_llm(path, **kwargs) -> LLM:
    return LLM(path, **{**dict(dtype="float32", block_size=16, max_model_len=512, progress=False), **kwargs})


def alone(path, ids, params=GREEDY) -> list[int]:
    return make_llm(path).generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids


@contextmanager
def indexer_outputs(layers, captured: dict):
    """While open, captured[i] is the output of layer i's indexer (full indexed layers)."""
    def keep(i, module, args, kwargs, out):
        captured[i] = out.clone()

    hooks = [layer.self_attn.indexer.register_forward_hook(partial(keep, i), with_kwargs=True)
             for i, layer in enumerate(layers) if getattr(layer.self_attn, "indexer", None) is not None]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def selections(indices: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(p for p in row.tolist() if p >= 0) for row in indices.reshape(-1, indices.shape[-1])]


def reference_run(ref, ids):
    captured = {}
    with indexer_outputs(ref.model.language_model.layers, captured), torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1), {i: selections(t[0]) for i, t in captured.items()}


def dsaserve_run(path, ids, block_size=16):
    """One prefill through dsaserve's paged path (a scrambled block table, state slot 1 of 2)."""
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(cfg, path, torch.float32, torch.device("cpu"), progress=False)
    blocks = -(-len(ids) // block_size)
    cache = KVCache(cfg, 2 * blocks + 1, block_size, torch.float32, torch.device("cpu"), state_slots=2)
    meta = BatchMetadata.build([ids], [0], [list(range(2 * blocks, 0, -2))], block_size, list(range(len(ids))),
                               state_slots=[1])
    captured = {}
    with indexer_outputs(model.model.layers, captured):
        logits = model.compute_logits(model(meta, cache.latent, cache.indexer))
    return logits.log_softmax(-1), {i: selections(t) for i, t in captured.items()}


def pool_margin(ref, ids) -> float:
    """Smallest relative gap, over full layers and queries that see more pools than they keep, between the last kept
    and the first dropped pool's score (recomputed from the reference indexer's own inputs and methods)."""
    margins = []

    def hook(module, args, kwargs):
        hidden, q_resid = kwargs["hidden_states"], kwargs["q_resid"]
        b, s, _ = hidden.shape
        q = module.wq_b(q_resid).view(b, s, -1, module.head_dim)
        k = module.k_norm(module.wk(hidden))
        packed = torch.cat([k, torch.nn.functional.linear(hidden, module.index_kpool_compress_gate),
                            torch.ones(b, s, 1)], -1)
        keys, _, _ = module.get_pooled_states(packed)
        scores = (q.float() @ keys.transpose(-1, -2).float().unsqueeze(1) * module.softmax_scale).relu()
        w = module.weights_proj(hidden).float() * module.n_heads**-0.5
        index = (w.unsqueeze(-2) @ scores).squeeze(-2)[0]
        keep = module.index_topk // module.index_kpool
        for t in range(s):
            visible = (t + 1) // module.index_kpool
            if visible > keep:
                top = index[t, :visible].topk(keep + 1).values
                margins.append(float((top[-2] - top[-1]) / (top.abs().max() + 1e-12)))

    layers = ref.model.language_model.layers
    hooks = [layer.self_attn.indexer.register_forward_pre_hook(hook, with_kwargs=True)
             for layer in layers if getattr(layer.self_attn, "indexer", None) is not None]
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return min(margins)


def first_selection_mismatch(ours: dict, expected: dict) -> str | None:
    if set(ours) != set(expected):
        return f"full layers differ: dsaserve {sorted(ours)} vs reference {sorted(expected)}"
    for layer in sorted(expected):
        for t, (a, b) in enumerate(zip(ours[layer], expected[layer])):
            if a != b:
                pools = sorted({p // KPOOL for p in a ^ b})
                return f"layer {layer} position {t}: selections differ in pools {pools}"
    return None


# ---- config ------------------------------------------------------------------------------------


def test_flash_config_resolves_from_the_published_fields():
    """tests/data/glm-5.3-flash-config.json: GLM-5.3-Flash's config as transformers' defaults write it (45 layers,
    every fourth indexed, the text fields under text_config)."""
    cfg = ModelConfig.from_dict(json.load(open(FLASH_CONFIG)))
    assert cfg.model_type == "glm5_next" and cfg.num_hidden_layers == 45
    assert cfg.hybrid.pattern == "KKKA" * 11 + "K"
    assert cfg.attention_layers == tuple(range(3, 45, 4)) and cfg.full_layers == cfg.attention_layers
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_cache_dim) == (0, 256, 256, 512)
    assert (cfg.hybrid.linear_num_heads, cfg.hybrid.linear_head_dim, cfg.hybrid.conv_kernel) == (64, 128, 4)
    assert cfg.hybrid.index_kpool == 16 and cfg.index_width == 2048 + 15
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse") and cfg.n_routed_experts == 288
    assert cfg.eos_token_ids == (154820, 154827, 154829)
    # Per request and KDA layer: a 64 × 128 × 128 fp32 state and 3 convolution inputs of 3 × 8192 channels.
    assert cfg.hybrid.state_bytes_per_request() == 34 * (64 * 128 * 128 + 3 * 3 * 8192) * 4


def test_linear_attn_config_is_the_authority_for_kda_fields():
    raw = json.load(open(FLASH_CONFIG))
    raw["text_config"]["linear_attn_config"] = {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 3,
                                                "gate_lower_bound": None, "safe_gate": False}
    hybrid = ModelConfig.from_dict(raw).hybrid
    assert (hybrid.linear_head_dim, hybrid.linear_num_heads, hybrid.conv_kernel, hybrid.gate_lower_bound) == \
        (64, 8, 3, None)


@pytest.mark.parametrize("change, field", [
    ({"layer_types": ["linear_attention"] * 45}, "indexed_attention"),
    ({"layer_types": ["mamba"] * 45}, "layer_types[0]='mamba'"),
    ({"index_kpool": 24}, "index_kpool=24"),
    ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim=64"),
    ({"indexer_types": ["shared"] * 45}, "layer 3"),
])
def test_bad_flash_fields_name_the_field(change, field):
    raw = json.load(open(FLASH_CONFIG))
    raw["text_config"].update(change)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(raw)


# ---- parity ------------------------------------------------------------------------------------


def test_prefill_matches_reference(path, ref):
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.hybrid.pattern == "KAAKKA" and cfg.indexer_schedule.pattern[1:3] == "FS"
    assert cfg.index_topk == INDEX_TOPK and cfg.hybrid.index_kpool == KPOOL and PROMPT_LEN >= 4 * INDEX_TOPK
    ids = prompt(cfg.vocab_size, PROMPT_LEN, seed=1)
    margin = pool_margin(ref, ids)
    assert margin > MIN_MARGIN, f"fixture has near-tied pool scores (margin {margin:.1e}); pick another seed"
    expected_logprobs, expected = reference_run(ref, ids)
    logprobs, ours = dsaserve_run(path, ids)
    mismatch = first_selection_mismatch(ours, expected)
    assert mismatch is None, mismatch
    assert any(len(s) < t + 1 for t, s in enumerate(expected[1])), "the indexer never pruned"
    diff = (logprobs - expected_logprobs).abs().max().item()
    assert diff < 1e-4, f"log-probabilities differ by {diff:.2e}"


def test_greedy_decode_matches_reference(path, ref):
    ids = prompt(ref.config.text_config.vocab_size, PROMPT_LEN, seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    out = make_llm(path).generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == reference_greedy(ref, ids, 32)
    with torch.no_grad():  # the chosen tokens' logprobs, against the reference over the whole sequence
        logits = ref(torch.tensor([ids + list(out.token_ids)])).logits[0, len(ids) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    ours = torch.tensor([entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids)])
    assert (ours - expected).abs().max().item() < 1e-4


def test_chunked_prefill_batching_and_preemption_equal_each_request_alone(path, ref):
    """37-token chunks split pools and KDA chunks (the state and the convolution's tail carry across them); three
    requests share steps, mixing prefill and decode rows; a cache of 10 blocks preempts, and recomputing starts the
    KDA state from zeros."""
    prompts = [prompt(ref.config.text_config.vocab_size, n, seed=10 + n) for n in (77, 70, 90)]
    expected = [alone(path, p) for p in prompts]
    assert expected[0] == reference_greedy(ref, prompts[0], GREEDY.max_tokens)
    chunked = make_llm(path, max_num_batched_tokens=37)
    outs = chunked.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    layout = chunked.engine.kv_layout
    per_block = layout.bytes_per_token * 16
    tight = make_llm(path, kv_cache_memory=10 * per_block + layout.state_bytes_per_request * 3, max_num_seqs=3,
                     max_model_len=128, state_snapshots=0)
    outs = tight.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert tight.engine.stats().num_free_blocks == 10 and len(tight.engine.scheduler.state_slots.free) == 3


def test_without_native_operators_requests_decoding_together_equal_each_alone(path, ref, monkeypatch):
    """A GPU's path on CPU (no native operator: the batched convolution and delta-rule steps of decode rows, and the
    pooled keys written at rows the host finds): three requests decoding together give each one's greedy tokens
    from the native path alone, the first the reference's."""
    prompts = [prompt(ref.config.text_config.vocab_size, n, seed=20 + n) for n in (47, 33, 60)]
    expected = [alone(path, p) for p in prompts]
    assert expected[0] == reference_greedy(ref, prompts[0], GREEDY.max_tokens)
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    outs = make_llm(path).generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_pool_ends_are_the_rows_that_complete_a_pool_found_without_a_read_back():
    """pool_ends from the host's lengths: chunks starting mid-pool and on a pool's edge, a decode row at a pool's end
    and one not, a chunk spanning three pools; the cache write it serves reads nothing back."""
    from replayed_graphs import HostReads

    from dsaserve.attention.pooled_keys import PooledKeyCache, pool_ends
    kpool, lens, contexts = 4, [6, 1, 1, 13, 3], [2, 7, 8, 0, 4]
    meta = BatchMetadata.build([[1] * n for n in lens], contexts, [[0, 1], [2], [3, 4], [5, 6], [7]], 16, [])
    expected = (meta.positions % kpool == kpool - 1).nonzero().flatten().tolist()
    assert pool_ends(meta, kpool).tolist() == expected == [1, 5, 6, 11, 15, 19]
    cache = PooledKeyCache(8, 16, 5, kpool, torch.float32, torch.device("cpu"))
    watch = HostReads()
    with watch:
        cache.write(meta, torch.randn(sum(lens), 5), torch.randn(sum(lens), 5), torch.zeros(kpool, 5))
    assert watch.seen == []


def test_decode_rows_select_the_pools_each_request_would_alone(monkeypatch):
    """select_decode_pools (a decode-only batch's pools scored together, up to its longest context) keeps for every
    row the pools the request-by-request selection keeps: no complete pool yet, fewer than index_topk / kpool, more,
    a row whose own token completes a pool; also when the score budget splits the batch."""
    from dsaserve.attention import pooled_keys
    from dsaserve.attention.pooled_keys import PooledKeyCache, select_decode_pools, select_request_pools
    kpool, dim, heads, keep = 4, 8, 3, 4
    gen = torch.Generator().manual_seed(5)
    contexts = [2, 9, 23, 40, 63]  # each request's one row sits at this position
    meta = BatchMetadata.build([[1]] * 5, contexts, [[0], [1], [2, 3], [4, 5, 6], [7, 8, 9, 10]], 16, [])
    cache = PooledKeyCache(11, 16, dim, kpool, torch.float32, torch.device("cpu"))
    cache.pools.normal_(generator=gen)
    queries, weights = torch.randn(5, heads, dim, generator=gen), torch.rand(5, heads, generator=gen) + 0.1
    for budget in (pooled_keys.SCORE_BUDGET, dim * 16 * 2):  # the whole batch at once; two rows at a time
        monkeypatch.setattr(pooled_keys, "SCORE_BUDGET", budget)
        alone, together = (torch.full((5, keep * kpool), -1, dtype=torch.int32) for _ in range(2))
        select_request_pools(queries, weights, cache, meta, keep, alone)
        select_decode_pools(queries, weights, cache, meta, keep, together)
        assert torch.equal(alone, together)
    assert (alone[0] == -1).all() and (alone[1, 2 * kpool:] == -1).all() and (alone[4] >= 0).all()


def test_parallel_samples_recompute_their_prompt(path, ref):
    """n > 1: the samples do not adopt sample 0's prompt blocks (their KDA state is not in them); each computes it."""
    ids = prompt(ref.config.text_config.vocab_size, 40, seed=5)
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    out = make_llm(path).generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0]
    expected = alone(path, ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [list(c.token_ids) for c in out.outputs] == [expected] * 2


# ---- loading and what is not served yet ----------------------------------------------------------


def test_vision_tower_is_skipped_with_a_log_line(path, caplog):
    with caplog.at_level(logging.INFO, logger="dsaserve.model.loader"):
        make_llm(path)
    assert any("vision tower" in r.getMessage() and "model.visual." in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("shared_len", [64, 70])  # the prefix ends at a snapshot / past one
def test_prefix_cache_hit_resumes_from_a_state_snapshot(path, ref, shared_len):
    """Snapshots every 32 tokens: a second request sharing 64 or 70 tokens resumes after 64 (its KV blocks and the
    KDA state kept there) and generates what it generates alone; the first request's own snapshots came from a
    prompt computed in 37-token chunks, so they are taken inside chunks."""
    vocab = ref.config.text_config.vocab_size
    shared = prompt(vocab, shared_len, seed=20)
    first, second = shared + prompt(vocab, 13, seed=21), shared + prompt(vocab, 19, seed=22)
    llm = make_llm(path, state_snapshot_interval=32, max_num_batched_tokens=37)
    llm.generate(prompt_token_ids=first, sampling_params=GREEDY, use_tqdm=False)
    out = llm.generate(prompt_token_ids=second, sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.metrics["num_prefix_hit_tokens"] == 64
    assert list(out.outputs[0].token_ids) == list(alone(path, second)) == reference_greedy(ref, second, 12)


def test_without_snapshots_prefix_caching_is_off_and_says_why(path, caplog):
    with caplog.at_level(logging.INFO, logger="dsaserve.engine.llm_engine"):
        llm = make_llm(path, state_snapshots=0)
    assert not llm.engine.scheduler.kv.enable_prefix_caching
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)


def test_without_kv_cache_memory_the_states_fit_a_share_of_the_memory_available(path, ref, monkeypatch, caplog):
    """No kv_cache_memory: max_num_seqs and state_snapshots are lowered (in proportion) until the KDA states fit a
    quarter of the memory available, the log says so, and four requests still all finish, two at a time."""
    per = make_llm(path, max_num_seqs=1).engine.kv_layout.state_bytes_per_request
    # 4 states fit: 2 running requests + 2 snapshots (asked: 8 + 8)
    monkeypatch.setattr(llm_engine, "memory_available", lambda device: int(per * 4.5 / DEFAULT_STATE_SHARE))
    with caplog.at_level(logging.WARNING, logger="dsaserve.engine.scheduling.cache_plan"):
        llm = make_llm(path, max_num_seqs=8, state_snapshots=8)
    assert llm.engine.scheduler.config.max_num_seqs == 2 and llm.engine.scheduler.config.state_snapshots == 2
    kda = next(c for c in llm.engine.kv_cache.latent if isinstance(c, LinearStateCache))
    assert kda.recurrent.shape[0] == 2 and kda.snapshot_recurrent.shape[0] == 2
    assert any("max_num_seqs lowered from 8 to 2" in r.getMessage() for r in caplog.records)
    prompts = [prompt(ref.config.text_config.vocab_size, 20 + n, seed=40 + n) for n in range(4)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [alone(path, p) for p in prompts]
    # given kv_cache_memory, the user's counts stand (and are checked against it)
    given = make_llm(path, max_num_seqs=8, state_snapshots=8,
                     kv_cache_memory=per * 16 + llm.engine.kv_layout.bytes_per_token * 512)
    assert given.engine.scheduler.config.max_num_seqs == 8
    monkeypatch.setattr(llm_engine, "memory_available", lambda device: int(per * 0.9 / DEFAULT_STATE_SHARE))
    with pytest.raises(ValueError, match="set kv_cache_memory"):
        make_llm(path)


def test_page_selection_is_refused_by_name(path):
    with pytest.raises(ValueError, match="attention_backend='page'"):
        make_llm(path, attention_backend="page")


def test_tensor_parallel_2_matches_reference(path, ref):
    """TP=2 (gloo, a worker process): MLA and KDA heads, MLPs and experts split; prompt log-probabilities of every
    position (1e-4) and a greedy continuation against the reference, chunked and batched with another request."""
    vocab = ref.config.text_config.vocab_size
    ids, other = prompt(vocab, PROMPT_LEN, seed=1), prompt(vocab, 50, seed=3)
    expected, _ = reference_run(ref, ids)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=37)
    try:
        out = llm.generate(prompt_token_ids=[ids, other], sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()
    ours = torch.tensor([out[0].prompt_logprobs[p + 1][ids[p + 1]].logprob for p in range(len(ids) - 1)])
    theirs = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert list(out[0].outputs[0].token_ids) == reference_greedy(ref, ids, 16)
    assert list(out[1].outputs[0].token_ids) == reference_greedy(ref, other, 16)


@pytest.fixture(scope="module")
def mtp_path(make_checkpoint):
    return make_checkpoint("glm5_next_mtp", seed=5, model_type="glm5_next", include_mtp=True)


@pytest.mark.parametrize("n_spec", [1, 3])
def test_mtp_speculation_keeps_reference_greedy_and_rolls_back_kda_state(mtp_path, monkeypatch, n_spec):
    """The MTP layer (model.language_model.layers.{num_hidden_layers}: indexed MLA + MoE, plain residual) drafts
    through the speculative path, chunked and batched; drafts replaced by the reference continuation with every third
    one wrong, so rounds are both accepted and rejected: a rejected draft's row has run through the KDA layers, and
    their state must come back to the last accepted row's for the output to stay the reference's greedy tokens."""
    from test_speculative import oracle_drafts
    ref_mtp = load_reference(mtp_path)
    vocab = ref_mtp.config.text_config.vocab_size
    prompts = [prompt(vocab, PROMPT_LEN, seed=1), prompt(vocab, 50, seed=3)]
    truth = [reference_greedy(ref_mtp, ids, 20) for ids in prompts]
    spec = {"method": "mtp", "num_speculative_tokens": n_spec, "disable_by_batch_size": None}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = make_llm(mtp_path, speculative_config=spec, max_num_batched_tokens=37)
    assert [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                           use_tqdm=False)] == truth  # the layer's own drafts
    llm = make_llm(mtp_path, speculative_config=spec, max_num_batched_tokens=37)
    by_prompt = {tuple(ids): out for ids, out in zip(prompts, truth)}
    oracle_drafts(monkeypatch, llm.engine.runner, lambda rid, state: by_prompt[tuple(state.prompt_token_ids)])
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == truth
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_mtp_speculation_at_tensor_parallel_2_drafts_what_one_rank_drafts(mtp_path):
    """TP=2 with the MTP layer drafting (its MLA heads and MoE split like the other layers'): the reference's greedy
    tokens, and the same drafts accepted as on one rank, so the split MTP layer predicts what the whole one does."""
    ref_mtp = load_reference(mtp_path)
    vocab = ref_mtp.config.text_config.vocab_size
    prompts = [prompt(vocab, PROMPT_LEN, seed=1), prompt(vocab, 50, seed=3)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = make_llm(mtp_path, speculative_config=spec, max_num_batched_tokens=37, tensor_parallel_size=tp)
        try:
            out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            stats = llm.engine.stats().spec_decode
        finally:
            llm.shutdown()
        runs.append(([o.outputs[0].token_ids for o in out], stats.num_draft_tokens, stats.num_accepted_tokens))
    assert runs[1][0] == [reference_greedy(ref_mtp, ids, 20) for ids in prompts]
    assert runs[1] == runs[0] and runs[1][1] > 0


def test_doctor_on_a_flash_checkpoint_with_its_mtp_layer(mtp_path):
    """Weights present: the indexer weights checked against the schedule over the indexed layers (the layer number
    read after `model.language_model.layers.`), the MTP layer found under the same prefix."""
    from test_cli import run
    result = run("doctor", mtp_path)
    assert result.returncode == 0, result.stderr
    assert "indexer weights on all 2 full layers and on none of the 1 shared layers" in result.stdout
    assert "every tensor matches the layout config.json describes" in result.stdout
    assert "MTP layer: model.language_model.layers.6 (49 tensors" in result.stdout


@pytest.mark.skipif(not torch_ops.load(), reason="dsaserve's torch operators could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_convolution_equals_the_torch_path(path, monkeypatch, dtype):
    """The native kda_conv (convolution and SiLU in one pass) against the torch operators, over a fresh request, one
    continuing its tail with a row (decode) and one with fewer rows than the tail: the same outputs but for the order
    of the fp32 sums (fp32: 1e-6; bf16: one rounding step), and the same carried inputs and snapshots."""
    from dsaserve.attention.linear_state import LinearStateCache
    from dsaserve.model.kda import KimiDeltaAttention
    cfg = ModelConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(9)
    kda = KimiDeltaAttention(cfg)
    kda.conv_weight.data = torch.randn(kda.conv_weight.shape, generator=g)
    channels = kda.conv_weight.shape[0]
    lens, contexts = [9, 1, 2], [0, 7, 5]
    meta = BatchMetadata.build([[1] * n for n in lens], contexts, [[0], [1], [2]], 16, [], state_slots=[0, 1, 2],
                               state_snapshots=[((4, 0),), (), ((6, 1),)])
    mixed = torch.randn(sum(lens), channels, generator=g).to(dtype)
    tails = torch.randn(3, cfg.hybrid.conv_kernel - 1, channels, generator=g)

    def run():
        state = LinearStateCache(cfg.hybrid, 3, torch.device("cpu"), num_snapshots=2)
        state.conv.copy_(tails)
        return kda.convolve(mixed, meta, state), state.conv.clone(), state.snapshot_conv.clone()

    native = run()
    with monkeypatch.context() as m:
        m.setattr(torch_ops, "load", lambda: False)
        reference = run()
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(native[0], reference[0], **tolerance)
    assert torch.equal(native[1], reference[1]) and torch.equal(native[2], reference[2])


def test_decode_rows_convolve_in_one_batched_step_as_each_would_alone(path, monkeypatch):
    """Without the native kda_conv (a GPU), a step's single-row requests convolve together (a fresh one, two
    continuing their tails, one keeping a snapshot among them, a prompt chunk beside them): every row and carried
    tail equal to convolve_torch's for that request alone, bit for bit."""
    from dsaserve.model.kda import KimiDeltaAttention, inputs_before
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    convolve_batched = KimiDeltaAttention.convolve_batched
    cfg = ModelConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(4)
    kda = KimiDeltaAttention(cfg)
    kda.conv_weight.data = torch.randn(kda.conv_weight.shape, generator=g)
    lens, contexts = [1, 5, 1, 1, 1], [7, 0, 0, 12, 3]
    snapshots = [(), (), (), ((13, 0),), ()]
    meta = BatchMetadata.build([[1] * n for n in lens], contexts, [[i] for i in range(5)], 16, [],
                               state_slots=[4, 0, 1, 2, 3], state_snapshots=snapshots)
    mixed = torch.randn(sum(lens), kda.conv_weight.shape[0], generator=g)
    state = LinearStateCache(cfg.hybrid, 5, torch.device("cpu"), num_snapshots=1)
    state.conv.copy_(torch.randn(state.conv.shape, generator=g))
    tails = state.conv.clone()
    batched = []
    monkeypatch.setattr(KimiDeltaAttention, "convolve_batched",
                        lambda self, *a: batched.append(a[3]) or convolve_batched(self, *a))
    out = kda.convolve(mixed, meta, state)
    assert batched == [[0, 2, 4]]  # the single rows that keep no snapshot
    for i, (slot, context) in enumerate(zip(meta.state_slots, contexts)):
        start, end = meta.query_range(i)
        tail = tails[slot] if context else torch.zeros_like(tails[slot])
        assert torch.equal(out[start:end], kda.convolve_torch(mixed[start:end], tail))
        assert torch.equal(state.conv[slot], inputs_before(tail, mixed[start:end], end - start))


@pytest.mark.skipif(not torch_ops.load(), reason="dsaserve's torch operators could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gated_norm_equals_the_torch_path(path, monkeypatch, dtype):
    """The native gated_rms_norm (KDA's output norm: RMSNorm per head times sigmoid(gate)) against the torch
    operators: equal but for the order of the fp32 sum (fp32: 1e-6; bf16: one rounding step)."""
    from dsaserve.model.kda import KimiDeltaAttention
    kda = KimiDeltaAttention(ModelConfig.from_pretrained(path))
    g = torch.Generator().manual_seed(2)
    kda.o_norm.weight.data = torch.randn(kda.head_dim, generator=g)
    o, gate = (torch.randn(7, kda.heads, kda.head_dim, generator=g).mul(3).to(dtype) for _ in range(2))
    native = kda.gated_norm(o, gate)
    with monkeypatch.context() as m:
        m.setattr(torch_ops, "load", lambda: False)
        reference = kda.gated_norm(o, gate)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(native, reference, **tolerance)


@pytest.mark.parametrize("tokens", [1, 37])
def test_native_delta_rule_equals_the_token_by_token_recurrence(body, tokens):
    """The native kda_delta (per body family) against torch's one-token step applied token by token and against the
    chunked form: outputs and the final state within fp32 rounding, with a state carried in and gates at KDA's lower
    bound's range; odd head sizes exercise the vector loops' tails."""
    from dsaserve.attention import delta_rule
    g = torch.Generator().manual_seed(tokens)
    heads, dk, dv = 3, 22, 27  # 27 = 16 + 11 columns, 22 = 5 × 4 + 2 rows: both loops' tails
    q, k = delta_rule.prepare(*(torch.randn(tokens, heads, dk, generator=g) for _ in range(2)))
    v = torch.randn(tokens, heads, dv, generator=g)
    gate = -5 * torch.rand(tokens, heads, dk, generator=g)
    beta = torch.rand(tokens, heads, generator=g)
    start = torch.randn(heads, dk, dv, generator=g)
    native_state, step_state, chunk_state = start.clone(), start.clone(), start.clone()
    native = torch.ops.dsaserve.kda_delta(q, k, v, gate, beta, native_state)
    steps = torch.stack([delta_rule.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1], beta[t:t + 1],
                                                   step_state[None])[0] for t in range(tokens)])
    chunked = delta_rule.chunked(q, k, v, gate, beta, chunk_state)
    for expected, state in ((steps, step_state), (chunked, chunk_state)):
        torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native_state, state, rtol=1e-5, atol=1e-5)


def test_build_demo_writes_a_flash_checkpoint_the_reference_agrees_with(tmp_path):
    """`dsaserve build-demo --model-type glm5_next DIR`: a random-weight GLM-5.3-Flash checkpoint (GLM tokenizer) that
    dsaserve serves and transformers loads, with the same greedy tokens for a chat prompt."""
    from test_cli import run
    target = str(tmp_path / "flash")
    assert run("build-demo", "--model-type", "glm5_next", target).returncode == 0
    llm = make_llm(target)
    ids = llm.tokenizer.encode("[gMASK]<sop><|user|>\nHello<|assistant|>")
    out = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert list(out) == reference_greedy(load_reference(target), ids, GREEDY.max_tokens)


def test_fp8_block_checkpoint_loads_within_fp8_error(make_checkpoint):
    """GLM-5.3-Flash as an FP8 checkpoint (128 × 128 blocks): KDA and MLA projections and the experts stored in
    e4m3 with their scales, KDA's convolution taps, norms, gates and mHC weights in their own dtype; every
    parameter loads as its bf16 twin's, within e4m3's error where stored in FP8."""
    from safetensors.torch import load_file
    dims = dict(model_type="glm5_next", dtype=torch.bfloat16)
    bf16, fp8 = make_checkpoint("flash_bf16", seed=7, **dims), make_checkpoint("flash_fp8", seed=7, fp8=True, **dims)
    stored = load_file(os.path.join(fp8, "model.safetensors"))
    layer = "model.language_model.layers.0.self_attn"
    assert stored[f"{layer}.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert f"{layer}.q_proj.weight_scale_inv" in stored
    assert stored[f"{layer}.q_conv1d.weight"].dtype != torch.float8_e4m3fn
    models = [load_model(ModelConfig.from_pretrained(p), p, torch.float32, torch.device("cpu"), progress=False)
              for p in (bf16, fp8)]
    exact, dequant = (dict(m.named_parameters()) for m in models)
    differ = 0
    for name, a in exact.items():
        b = dequant[name]
        if not torch.equal(a, b):  # e4m3: relative error ≤ 2^-4, plus the block's subnormal step
            assert ((a - b).abs() <= a.abs() * 2**-4 + a.abs().max() * 2**-9).all(), name
            differ += 1
    assert differ > 10 and any(".self_attn.q_proj" in n for n in exact)


@pytest.mark.parametrize("mode", QUANTIZATION_MODES)
def test_quantized_weights_equal_their_dequantized_twin(path, ref, monkeypatch, mode):
    """Weight-only fp8/int8/int4 as for GLM-5.2: KDA's projections are packed too (not its convolution taps), and
    the model decodes what the same weights dequantized to floats decode, logprobs within 1e-4."""
    vocab = ref.config.text_config.vocab_size
    prompts = [prompt(vocab, 70 + 9 * i, seed=60 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)

    def run(llm):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])

    llm = make_llm(path, quantization=mode, max_num_batched_tokens=40)
    packed = {n for n, m in llm.engine.model.named_modules() if isinstance(m, QuantizedWeight)}
    assert "model.layers.0.self_attn.q_proj.weight" in packed and not any("conv" in n for n in packed)  # 0: KDA
    assert_same_outputs(run(llm), run(twin_of(llm, path, monkeypatch)))
