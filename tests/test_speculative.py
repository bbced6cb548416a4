"""MTP speculative decoding on tiny checkpoints that carry an MTP layer: greedy output identical to decoding
without it (batches, 7-token chunks, prefix hits, preemption, n = 2), the sampled distribution unchanged
(and a wrong acceptance rule caught), rollback, index sharing against a reference draft step written from
the formulas, and loading."""

import collections
import sys

import pytest
import torch

import dsaserve.engine.workers.model_runner as runner_module
from dsaserve.demo.mtp_block import write_mtp_block_checkpoint
from dsaserve.engine.speculative.rejection_sampler import verify_drafts
from dsaserve.llm import LLM
from dsaserve.model.loader import CheckpointError
from dsaserve.sampling.sampler import top_logprobs
from dsaserve.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5 + (7 * i) % 300 for i in range(n)]} for n in (3, 17, 40, 29)]


@pytest.fixture(scope="module")
def mtp_checkpoint(make_checkpoint):
    return make_checkpoint("tiny-mtp", seed=3, include_mtp=True)


def make_llm(checkpoint, n_spec=None, **kwargs):
    # Drafting at every batch size: these tests check what speculation does, not when it pays.
    spec = (None if n_spec is None
            else {"method": "mtp", "num_speculative_tokens": n_spec, "disable_by_batch_size": None})
    args = dict(dtype="float32", block_size=16, max_model_len=256, progress=False, speculative_config=spec)
    return LLM(checkpoint, **{**args, **kwargs})


def token_ids(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(mtp_checkpoint):
    return token_ids(make_llm(mtp_checkpoint), PROMPTS, GREEDY)


def oracle_drafts(monkeypatch, runner, reference_of, wrong_every: int = 3):
    """Replace the MTP layer's drafts (after it ran, so its caches fill as usual) with the reference
    continuation, every `wrong_every`-th draft corrupted: acceptances and rejections both happen."""
    from dsaserve.engine.speculative.mtp_drafter import propose as real
    calls = collections.Counter()

    def propose(model, kv_cache, inputs, hidden, share, graphs=None):
        drafts = real(model, kv_cache, inputs, hidden, share, graphs)
        for request_id, tokens in drafts.items():
            state = runner.requests[request_id]
            done = len(state.output_token_ids)
            truth = reference_of(request_id, state)
            for j in range(len(tokens)):
                calls["drafts"] += 1
                right = truth[done + j] if done + j < len(truth) else tokens[j]
                tokens[j] = right if (calls["drafts"] % wrong_every) else (right + 1) % 200
        return drafts

    monkeypatch.setattr(runner_module, "propose", propose)
    return calls


@pytest.mark.parametrize("n_spec", [1, 2, 3])
def test_greedy_output_is_unchanged_by_speculation(mtp_checkpoint, reference, n_spec):
    llm = make_llm(mtp_checkpoint, n_spec)
    assert token_ids(llm, PROMPTS, GREEDY) == reference


@pytest.mark.parametrize("n_spec", [1, 2, 3])
def test_greedy_output_is_unchanged_with_accepted_drafts_chunks_prefix_hits_preemption_and_n2(
        mtp_checkpoint, monkeypatch, n_spec):
    """Drafts that are mostly right (so whole rounds are accepted) through every scheduling corner at once:
    7-token chunks, a shared prefix served from the cache, requests preempted and recomputed, and two
    samples per request."""
    prefix = [9 + (5 * i) % 250 for i in range(48)]
    prompts = [{"prompt_token_ids": prefix + [40 + i, 41 + i]} for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2)
    small = dict(max_num_batched_tokens=7, max_num_seqs=8)
    expected = token_ids(make_llm(mtp_checkpoint, **small), prompts, params)
    by_prompt = {tuple(p["prompt_token_ids"]): out[0] for p, out in zip(prompts, expected)}
    llm = make_llm(mtp_checkpoint, n_spec, **small)
    calls = oracle_drafts(monkeypatch, llm.engine.runner, lambda rid, state: by_prompt[tuple(state.prompt_token_ids)])
    sched = llm.engine.scheduler
    original, steps = sched.schedule, collections.Counter()

    def schedule_with_preemption():  # every ninth step, the newest running sequence is preempted first
        steps["n"] += 1
        if steps["n"] % 9 == 0 and len(sched.running) > 1:
            sched._preempt(sched.running[-1])
        return original()

    monkeypatch.setattr(sched, "schedule", schedule_with_preemption)
    assert token_ids(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert calls["drafts"] > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0


def test_speculation_pauses_at_the_configured_batch_size(mtp_checkpoint, reference):
    def drafts_with(limit):
        llm = make_llm(mtp_checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                          "disable_by_batch_size": limit})
        assert token_ids(llm, PROMPTS, GREEDY) == reference
        return llm.engine.stats().spec_decode.num_drafts

    assert drafts_with(5) > 0  # four sequences run together, all to the same length
    assert drafts_with(4) == 0


def test_speculation_pauses_from_batch_8_unless_told_otherwise():
    from dsaserve.speculative_config import SpeculativeConfig

    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}').disable_by_batch_size == 8
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2,
                                    "disable_by_batch_size": None}).disable_by_batch_size is None


@pytest.mark.parametrize("penalties", [True, False], ids=["penalties", "plain greedy"])
def test_penalties_logprobs_and_stop_strings_see_the_accepted_drafts(mtp_checkpoint, monkeypatch, penalties):
    """Verification edits each row as if the drafts before it had been sampled: penalties and the
    returned log-probabilities (the target's) come out as without speculation; a stop string inside a
    round of accepted drafts ends the text at the same place. Without penalties the requests are verified together
    (verify_greedy), their logprobs read back with the argmax."""
    edits = {"repetition_penalty": 1.3, "frequency_penalty": 0.5} if penalties else {}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3, **edits)
    plain = make_llm(mtp_checkpoint).generate(PROMPTS, params, use_tqdm=False)
    truth = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain)}
    llm = make_llm(mtp_checkpoint, 3)
    calls = oracle_drafts(monkeypatch, llm.engine.runner, lambda rid, state: truth[tuple(state.prompt_token_ids)])
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0 and calls["drafts"] > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4
    stop = plain[1].outputs[0].text[5:8]
    with_stop = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    expected = make_llm(mtp_checkpoint).generate([PROMPTS[1]], with_stop, use_tqdm=False)[0].outputs[0]
    got = llm.generate([PROMPTS[1]], with_stop, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason) and got.finish_reason == "stop"


def test_blocks_completed_by_accepted_drafts_are_cached_under_their_tokens(mtp_checkpoint, reference, monkeypatch):
    """A block filled by accepted drafts is registered with the tokens it holds: a later request whose
    prompt is the first one's prompt and output finds all of those blocks."""
    llm = make_llm(mtp_checkpoint, 3)
    truth = {tuple(p["prompt_token_ids"]): out[0] for p, out in zip(PROMPTS, reference)}
    oracle_drafts(monkeypatch, llm.engine.runner, lambda rid, state: truth[tuple(state.prompt_token_ids)],
                  wrong_every=1000)
    first = PROMPTS[2]["prompt_token_ids"]
    llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 10
    again = first + truth[tuple(first)]
    before = llm.engine.stats().prefix_cache_hit_tokens
    llm.generate([{"prompt_token_ids": again}], SamplingParams(max_tokens=1), use_tqdm=False)
    # 63 tokens were computed: three full blocks cached (positions 32-47 filled by accepted drafts); the
    # last is given up to the MTP layer's catch-up.
    assert llm.engine.stats().prefix_cache_hit_tokens - before == 32


def test_rollback_leaves_no_rejected_draft_visible(mtp_checkpoint, reference, monkeypatch):
    """Without the rollback, a rejected draft would stay in the sequence: its position counted as computed
    and its cache rows attended by every later token. The output then departs from the reference."""
    from dsaserve.engine.scheduling.scheduler import Scheduler

    llm = make_llm(mtp_checkpoint, 3)
    original = Scheduler.update_from_output

    def no_rollback(self, scheduler_output, runner_output):
        for s in scheduler_output.scheduled:
            sampled = runner_output.sampled_token_ids.get(s.request_id)
            if s.spec_token_ids and sampled is not None:  # keep every draft, as if all were accepted
                runner_output.sampled_token_ids[s.request_id] = list(s.spec_token_ids) + [sampled[-1]]
        return original(self, scheduler_output, runner_output)

    monkeypatch.setattr(Scheduler, "update_from_output", no_rollback)
    assert token_ids(llm, PROMPTS, GREEDY) != reference


def test_sampled_distribution_is_the_targets(mtp_checkpoint, monkeypatch):
    """The second token (the first to go through verification) over many seeds: with speculation its
    distribution matches plain sampling (chi-square), verified together (verify_random) or one by one,
    while an acceptance rule that keeps the draft whenever the target gives it any probability is caught."""
    prompt = [{"prompt_token_ids": [11, 12, 13, 14]}]
    # Three tokens: after the first, one draft fits (the last token must stay the target's own).
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(1500)]

    def second_tokens(llm):
        outs = llm.generate(prompt * len(params), params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)

    plain = second_tokens(make_llm(mtp_checkpoint, max_num_seqs=256))
    # Drafts that are often right: the most common continuation of each first token.
    common = {}
    for (first, second), count in plain.most_common():
        common.setdefault(first, second)

    def drafts_from_common(runner):
        from dsaserve.engine.speculative.mtp_drafter import propose as real

        def propose(model, kv_cache, inputs, hidden, share, graphs=None):
            drafts = real(model, kv_cache, inputs, hidden, share, graphs)
            for request_id, tokens in drafts.items():
                last = runner.requests[request_id].output_token_ids[-1]
                tokens[0] = common.get(last, tokens[0])
            return drafts
        return propose

    def speculative_counts(verify=None):
        llm = make_llm(mtp_checkpoint, 1, max_num_seqs=256)
        monkeypatch.setattr(runner_module, "propose", drafts_from_common(llm.engine.runner))
        if verify is not None:  # one request at a time, as those whose logits are edited are verified
            monkeypatch.setattr(runner_module, "plain_random", lambda state: False)
            monkeypatch.setattr(runner_module, "verify_drafts", verify)
        return second_tokens(llm)

    def greedy_acceptance(logits, drafts, state, rng):  # wrong: keeps any draft the target allows
        from dsaserve.sampling.sampler import apply_filters
        probs = apply_filters(logits[:1], [state.params]).softmax(-1)[0]
        if probs[drafts[0]] > 0:
            return [drafts[0]] + verify_drafts(logits[1:], [], state, rng)
        return verify_drafts(logits, drafts, state, rng)

    batched = speculative_counts()  # (first: the others keep their patches)
    one_by_one, wrong = speculative_counts(verify_drafts), speculative_counts(greedy_acceptance)
    assert chi_square_p(plain, batched) > 1e-3 and chi_square_p(plain, one_by_one) > 1e-3
    assert chi_square_p(plain, wrong) < 1e-6


def test_sampled_requests_are_verified_together_in_one_read(monkeypatch):
    """verify_random (the plain random requests of a step, every row's draws made before one read back): a draft the
    filtered target holds with probability 1 is accepted, one it cannot give is replaced by what it can, k accepted
    drafts get the bonus row's token; a NaN row fails its request alone; a seeded request's verdict is the same in any
    company."""
    from dsaserve.engine.speculative.rejection_sampler import plain_random, verify_random
    from dsaserve.engine.workers.runner_state import RunnerRequest

    vocab = 30
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1)
    top1 = SamplingParams(temperature=0.7, top_k=1)  # each row's distribution: its argmax alone

    def state(params, seed):
        return RunnerRequest(params, [1], frozenset(), torch.Generator().manual_seed(seed), False)

    states = [state(top1, 1), state(top1, 2), state(SamplingParams(temperature=1.0, seed=3), 3)]
    assert all(plain_random(s) for s in states)
    drafts = [[int(best[0]), int(best[1])], [int(best[3]), (int(best[4]) + 1) % vocab], [5, 6]]
    logits[7, 4] = float("nan")  # the third request's second row
    reads = collections.Counter()
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.update(["tolist"]) or original(t))
    verdicts = verify_random(logits, drafts, states, torch.Generator().manual_seed(0))
    assert reads["tolist"] == 1
    monkeypatch.undo()
    assert verdicts[0] == [int(best[0]), int(best[1]), int(best[2])]  # both drafts, then the bonus row's argmax
    assert verdicts[1] == [int(best[3]), int(best[4])]  # the second draft rejected, the only token left instead
    assert isinstance(verdicts[2], str) and "non-finite" in verdicts[2]
    seeded = state(SamplingParams(temperature=1.0, seed=9), 9)
    company = verify_random(torch.cat([logits[:3], logits[:3]]), [drafts[0], [0, 1]],
                            [state(SamplingParams(temperature=1.0), 4), seeded], torch.Generator().manual_seed(5))
    seeded.generator.manual_seed(9)
    alone = verify_random(logits[:3], [[0, 1]], [seeded], torch.Generator().manual_seed(6))
    assert company[1] == alone[0]


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """p-value of a two-sample chi-square test of homogeneity; categories seen fewer than 10 times in
    both samples together are pooled into one."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rest = [k for k in keys if k not in big]
    table = torch.tensor([[a[k] for k in big] + [sum(a[k] for k in rest)],
                          [b[k] for k in big] + [sum(b[k] for k in rest)]], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


# ---- index sharing and the draft step ------------------------------------------------------------


@pytest.mark.parametrize("share", [True, False])
def test_the_mtp_indexer_runs_once_per_round_when_shared(make_checkpoint, monkeypatch, share):
    """A round that drafts runs the MTP indexer once, for its first draft (the catch-up rows before it only
    write their keys), and again in draft steps 2…N only when index_share_for_mtp_iteration is off; a
    round without drafts (a prompt chunk) never runs it."""
    from dsaserve.engine.speculative.mtp_drafter import propose as real

    checkpoint = make_checkpoint(f"tiny-mtp-share-{share}", seed=4, include_mtp=True,
                                 index_share_for_mtp_iteration=share)
    llm = make_llm(checkpoint, 3)
    indexer = llm.engine.model.mtp.block.self_attn.indexer
    runs, rounds = collections.Counter(), []
    real_forward = indexer.forward

    def counted(*args, **kwargs):
        runs["indexer"] += 1
        return real_forward(*args, **kwargs)

    def recorded(model, kv_cache, inputs, hidden, share_index, graphs=None):
        rounds.append(max(item.num_drafts for item in inputs))
        return real(model, kv_cache, inputs, hidden, share_index, graphs)

    indexer.forward = counted
    monkeypatch.setattr(runner_module, "propose", recorded)
    llm.generate([PROMPTS[2]], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True), use_tqdm=False)
    assert max(rounds) == 3
    assert 0 in rounds and runs["indexer"] == sum((n > 0) + (0 if share else max(n - 1, 0)) for n in rounds)


def test_the_drafter_reads_its_drafts_back_once_a_round(mtp_checkpoint, monkeypatch):
    """Each draft step feeds its tokens to the next on the device: a round of 3 drafts reads them back to the host
    once (on a GPU, one synchronisation a round instead of one a draft), and every round does read them."""
    from dsaserve.engine.speculative.mtp_drafter import propose as real

    llm = make_llm(mtp_checkpoint, 3)
    reads, rounds = collections.Counter(), []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            reads[len(rounds)] += sys._getframe(1).f_code.co_filename.endswith("mtp_drafter.py")
            return original(self, *args)
        return read

    def recorded(model, kv_cache, inputs, hidden, share_index, graphs=None):
        rounds.append(max(item.num_drafts for item in inputs))
        with monkeypatch.context() as patch:
            for name in ("tolist", "item", "__int__", "__bool__", "cpu"):
                patch.setattr(torch.Tensor, name, counted(name))
            return real(model, kv_cache, inputs, hidden, share_index, graphs)

    monkeypatch.setattr(runner_module, "propose", recorded)
    llm.generate([PROMPTS[2]], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True), use_tqdm=False)
    assert max(rounds) == 3
    assert [reads[i + 1] for i in range(len(rounds))] == [int(n > 0) for n in rounds]


def test_greedy_requests_are_verified_together_as_each_alone(monkeypatch):
    """verify_greedy (the plain greedy requests of a step, their rows read back once) commits what verify_drafts
    commits for each request: every draft accepted, the first rejected, one in the middle; a request whose rows hold
    a NaN fails alone, and one whose row sum overflows (every logit finite) does not."""
    from dsaserve.engine.speculative.rejection_sampler import plain_greedy, verify_greedy
    from dsaserve.engine.workers.runner_state import RunnerRequest

    g = torch.Generator().manual_seed(5)
    vocab, k = 40, 3
    logits = torch.randn(5 * (k + 1), vocab, generator=g)
    best = logits.argmax(-1).view(5, k + 1)
    wrong = (best + 1) % vocab
    drafts = [best[0, :k].tolist(), [int(wrong[1, 0]), 3, 4], [int(best[2, 0]), int(wrong[2, 1]), 7],
              best[3, :k].tolist(), best[4, :k].tolist()]
    logits[3 * (k + 1) + 2, 5] = float("nan")
    logits[4 * (k + 1) + 1, :2] = 3e38  # the sum overflows, every logit finite
    state = RunnerRequest(SamplingParams(temperature=0), [1, 2], frozenset(), None, False)
    assert plain_greedy(state)
    reads = collections.Counter()
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.update(["tolist"]) or original(t))
    verdicts = verify_greedy(logits, drafts, num_logprobs=2)
    got = verdicts.committed
    assert reads["tolist"] == 1
    monkeypatch.undo()
    expected = []
    for i, request_drafts in enumerate(drafts):
        try:
            expected.append(verify_drafts(logits[i * (k + 1):(i + 1) * (k + 1)], request_drafts, state, None))
        except ValueError:
            expected.append(None)
    assert got == expected
    assert [len(c) if c else None for c in got] == [k + 1, 1, 2, None, 2]
    # Each row's logprobs, its argmax chosen (the committed token wherever one is), in that same read.
    expected_top = top_logprobs(logits.log_softmax(-1), logits.argmax(-1), 2)
    assert verdicts.top[:2 * (k + 1)] == expected_top.host_rows()[:2 * (k + 1)]


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def shared_selection(last: int):
    """A forward hook for the reference block's indexer: rows after `last` (the draft rows) attend to the
    selection row `last` made plus the positions drafted since, as with index_share_for_mtp_iteration."""
    def hook(module, args, out):
        rows = out.shape[1]  # out: [1, rows, index_topk] positions
        extra = max(rows - 1 - last, 0)
        wide = torch.cat([out, out[..., :1].expand(-1, -1, extra)], dim=-1)  # repeats scatter harmlessly
        for t in range(last + 1, rows):
            new = torch.arange(last + 1, t + 1, dtype=out.dtype)
            pad = new[-1:].expand(extra - len(new))
            wide[:, t] = torch.cat([out[0, last], new, pad])[None]
        return wide
    return hook


def reference_drafts(target, block, own, sequence: list[int], num: int, share: bool = False) -> list[torch.Tensor]:
    """Draft logits for a verified sequence (its last token not yet computed by the target), from the
    formulas: the block runs over the whole sequence of MTP rows at once, one more row per draft."""
    eps = target.config.rms_norm_eps
    captured = {}

    def keep(name):
        return lambda module, args, out: captured.__setitem__(name, out[0] if isinstance(out, tuple) else out)

    hooks = [target.model.norm.register_forward_hook(keep("target")),
             block.model.layers[0].register_forward_hook(keep("block"))]
    if share:
        hooks.append(block.model.layers[0].self_attn.indexer.register_forward_hook(shared_selection(len(sequence) - 2)))
    try:
        with torch.no_grad():
            target(torch.tensor([sequence[:-1]]))
            hidden, tokens, logits = captured["target"][0], sequence[1:], []  # h_p after the final norm
            for _ in range(num):
                embeds = block.model.embed_tokens(torch.tensor(tokens))
                embeds[0] = 0  # position 0
                x = torch.cat([rms(embeds, own["enorm"], eps), rms(hidden, own["hnorm"], eps)], -1) @ own["eh_proj"].T
                logits.append(block(inputs_embeds=x[None]).logits[0, -1].float())
                hidden = torch.cat([hidden, captured["block"][0][-1:]])  # the block's output feeds the next row
                tokens = tokens + [int(logits[-1].argmax())]
    finally:
        for h in hooks:
            h.remove()
    return logits


@pytest.mark.parametrize("share", [False, True])
def test_drafts_match_a_reference_draft_step_built_from_the_formulas(make_checkpoint, tmp_path, share):
    """Draft k: h_k = block(eh_proj(cat[enorm(embed(t_k)), hnorm(h_{k-1})])), logits = head(norm(h_k)),
    with h_0 the target's hidden state after its final norm (as vLLM feeds it) and the embedding zeroed at
    position 0.
    dsaserve fills the MTP cache with catch-up rows step by step (keeping only verified ones) and drafts
    one row at a time; after every step its draft logits match the reference's for the sequence verified
    so far, the prompt having gone through in 7-token chunks. A prompt longer than index_topk makes the
    MTP indexer's selection matter; with index sharing,
    the reference's draft rows attend to the first step's selection plus the positions drafted since."""
    from reference import load_reference

    checkpoint = make_checkpoint(f"tiny-mtp-ref-{share}", seed=6, include_mtp=True, index_share_for_mtp_iteration=share)
    target = load_reference(checkpoint)
    own = write_mtp_block_checkpoint(checkpoint, str(tmp_path / "block"))
    block = load_reference(str(tmp_path / "block"))
    for prompt in ([3, 9, 27, 81, 243], [7 + (11 * i) % 400 for i in range(37)]):
        engine = make_llm(checkpoint, 3, max_num_batched_tokens=7).engine  # prompt chunks catch up too
        seen = []
        real = engine.model.draft_logits
        engine.model.draft_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
        engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        checked = 0
        while engine.has_unfinished_requests():
            seen.clear()
            engine.step()
            request = engine.scheduler.requests.get("r")
            if request is None or not request.spec_token_ids:
                continue
            expected = reference_drafts(target, block, own, prompt + request.output_token_ids, len(seen), share)
            for ours, theirs in zip(seen, expected):
                torch.testing.assert_close(ours[0], theirs, atol=2e-4, rtol=2e-4)
            assert request.spec_token_ids == [int(t.argmax()) for t in expected]
            checked += 1
        assert checked >= 3


def test_a_checkpoint_without_an_mtp_layer_refuses_speculation(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no MTP layer.*drop --speculative-config"):
        make_llm(tiny_checkpoint, 2)


def test_a_truncated_mtp_layer_is_named(make_checkpoint, tmp_path):
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    source = make_checkpoint("tiny-mtp-trunc-src", seed=5, include_mtp=True)
    target = tmp_path / "truncated"
    shutil.copytree(source, target)
    weights = load_file(os.path.join(target, "model.safetensors"))
    del weights["model.layers.4.eh_proj.weight"]
    save_file(weights, os.path.join(target, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.4.eh_proj.weight"):
        make_llm(str(target), 1)
    make_llm(str(target))  # without speculation the MTP layer is not read


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "num_speculative_tokens": 2}', "method"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "mtp"', "not JSON"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown keys"),
])
def test_bad_speculative_configs_are_refused_before_loading(config, message):
    from dsaserve.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=config)


SPEC_FLAG = '{"method": "mtp", "num_speculative_tokens": 2}'


def test_generate_and_bench_take_the_flag_and_doctor_reports_the_layer(mtp_checkpoint, tiny_checkpoint, tmp_path):
    import json

    from test_cli import run

    common = ["--dtype", "float32", "--block-size", "16", "--max-model-len", "256"]
    plain = run("generate", mtp_checkpoint, "--prompt", "hello there", "--max-tokens", "9", "--ignore-eos", *common)
    spec = run("generate", mtp_checkpoint, "--prompt", "hello there", "--max-tokens", "9", "--ignore-eos", *common,
               "--speculative-config", SPEC_FLAG)
    assert spec.returncode == 0 and spec.stdout == plain.stdout, spec.stderr
    bench = run("bench", "latency", mtp_checkpoint, *common, "--input-len", "12", "--output-len", "8",
                "--num-iters", "1", "--speculative-config", SPEC_FLAG, "--output-json", str(tmp_path / "l.json"))
    assert bench.returncode == 0, bench.stderr
    data = json.loads((tmp_path / "l.json").read_text())
    assert data["spec_decode_num_drafts"] > 0 and data["spec_decode_mean_accepted_length"] >= 1
    assert len(data["spec_decode_acceptance_per_position"]) == 2
    assert "MTP layer: model.layers.4 (" in run("doctor", mtp_checkpoint).stdout
    assert "MTP layer: none" in run("doctor", tiny_checkpoint).stdout
    refused = run("generate", tiny_checkpoint, "--prompt", "x", "--speculative-config", SPEC_FLAG)
    assert refused.returncode != 0 and "no MTP layer" in refused.stderr and "Traceback" not in refused.stderr


def test_the_server_speculates_and_reports_acceptance_in_metrics(mtp_checkpoint):
    import httpx
    from server_process import ServerProcess

    srv = ServerProcess(mtp_checkpoint, "--speculative-config", SPEC_FLAG).wait_ready()
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        metrics = srv.metrics()
        assert metrics["dsaserve:spec_decode_num_drafts_total"] > 0
        assert (metrics["dsaserve:spec_decode_num_draft_tokens_total"]
                >= metrics["dsaserve:spec_decode_num_drafts_total"])
        assert "dsaserve:spec_decode_num_accepted_tokens_total" in metrics
        assert "dsaserve:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    finally:
        srv.stop()
