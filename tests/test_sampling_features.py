"""n > 1, seeds, penalties, logit_bias, stop strings, min_tokens, and incremental detokenization."""

import pytest
import torch

from dsaserve import LLM, SamplingParams
from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.workers.runner_state import RunnerRequest
from dsaserve.sampling.logits_processors import process_logits


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, progress=False)


def gen(llm, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("ignore_eos", True)
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def test_n_samples_share_the_prompt_and_differ(llm):
    prompt = "the quick brown fox jumps over the lazy dog and " * 2
    out = gen(llm, prompt, n=3, temperature=1.0, seed=11, max_tokens=10)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 10 for s in samples) and len({tuple(s) for s in samples}) == 3
    assert gen(llm, prompt, n=3, temperature=1.0, seed=11, max_tokens=10).outputs == out.outputs
    greedy = gen(llm, prompt, n=2, max_tokens=8)
    assert (greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
            == gen(llm, prompt, max_tokens=8).outputs[0].token_ids)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_n_samples_share_full_prompt_blocks(llm):
    engine = llm.engine
    prompt = list(range(40, 90))  # 50 tokens: 3 full blocks + a partial one
    engine.add_request("fork", prompt, SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=1))
    engine.step()  # sample 0 computes the prompt
    engine.step()  # samples 1 and 2 are admitted on its cached blocks
    group = [engine.scheduler.requests[f"fork#{i}"] for i in range(3)]
    shared = group[0].block_table[:3]
    assert all(s.block_table[:3] == shared for s in group)
    assert all(engine.scheduler.kv.ref_counts[b] == 3 for b in shared)
    assert [s.num_prefix_hit_tokens for s in group] == [0, 48, 48]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_seed_gives_same_output_in_any_company(llm):
    params = dict(temperature=0.9, top_k=50, max_tokens=12, seed=5)
    alone = gen(llm, "hello there", **params).outputs[0].token_ids
    crowd = llm.generate(["some other text", "hello there", "x"], SamplingParams(**params, ignore_eos=True),
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def request_for(prompt_ids, output_ids, **params) -> RunnerRequest:
    return RunnerRequest(SamplingParams(**params), prompt_ids, frozenset({0}), None, False, list(output_ids))


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 6)
    req = request_for([5], [1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [req])[0]
    assert out.tolist() == pytest.approx([0, -1.0, -0.75, 0, 0, 0])  # 1: 0.5 + 2×0.25, 2: 0.5 + 0.25
    assert torch.equal(logits, torch.zeros(1, 6))  # the raw logits (for logprobs) stay untouched


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0]])
    out = process_logits(logits, [request_for([0], [1], repetition_penalty=2.0)])[0]
    assert out.tolist() == [1.0, -4.0, 2.0, 2.0]


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(1, 4)
    out = process_logits(logits, [request_for([1], [], logit_bias={"3": 5.0}, min_tokens=2)])[0]
    assert out[3] == 5.0 and out[0] == float("-inf")  # token 0 is the stop token, masked before min_tokens


def test_logit_bias_steers_generation(llm):
    out = gen(llm, "hello", max_tokens=5, logit_bias={42: 100})
    assert out.outputs[0].token_ids == [42] * 5


def test_penalty_reduces_repetition(llm):
    plain = gen(llm, "a", max_tokens=40).outputs[0].token_ids
    penalized = gen(llm, "a", max_tokens=40, frequency_penalty=2.0, presence_penalty=2.0).outputs[0].token_ids
    assert len(set(penalized)) > len(set(plain))


def test_stop_string_spanning_two_tokens(llm):
    base = gen(llm, "hello world", max_tokens=30).outputs[0]
    pieces = [llm.tokenizer.decode([t]) for t in base.token_ids]
    # a stop string made of the last character of one token and the first of the next
    def boundary(i):  # where token i's text ends inside the output text
        return len(llm.tokenizer.decode(base.token_ids[: i + 1]))

    candidates = [(pieces[i][-1] + pieces[i + 1][0], boundary(i) - 1) for i in range(2, len(pieces) - 1)
                  if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]]
    stop, cut = next((s, c) for s, c in candidates if base.text.find(s) == c)  # first occurrence spans the boundary
    out = gen(llm, "hello world", max_tokens=30, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut] and stop not in out.text
    kept = gen(llm, "hello world", max_tokens=30, stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == base.text[: cut + len(stop)]


def test_streamed_deltas_never_leak_the_stop_string(llm):
    base = gen(llm, "hello world", max_tokens=30).outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    engine = llm.engine
    engine.add_request("s", "hello world", SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text if out.outputs else "")
    streamed = "".join(deltas)
    assert streamed == base.text[: base.text.find(stop)]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_min_tokens_holds_back_eos(llm):
    eos = llm.engine.config.eos_token_ids[0]
    original = llm.engine.model.compute_logits

    def eos_first(hidden):
        logits = original(hidden)
        logits[:, eos] = 1e4
        return logits

    llm.engine.model.compute_logits = eos_first
    try:
        out = gen(llm, "hi", max_tokens=10, ignore_eos=False, min_tokens=4).outputs[0]
    finally:
        llm.engine.model.compute_logits = original
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


def test_incremental_detokenizer_never_splits_characters(llm):
    tok = llm.tokenizer
    text = "naïve café – 你好, wörld! 🙂 end"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=[], include_stop=False)
    deltas = []
    for token in ids:
        detok.add(token)
        deltas.append(detok.delta(finished=False))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # some tokens ended mid-character and were held back


def test_stop_token_text_stays_out_of_the_output(llm):
    base = gen(llm, "hello world", max_tokens=20).outputs[0]
    k = next(i for i, t in enumerate(base.token_ids)
             if i >= 2 and llm.tokenizer.decode([t]).isascii() and llm.tokenizer.decode([t]).strip()
             and t not in base.token_ids[:i])
    stop = base.token_ids[k]
    out = gen(llm, "hello world", max_tokens=20, stop_token_ids=[stop]).outputs[0]
    assert out.token_ids == base.token_ids[: k + 1] and out.stop_reason == stop
    assert out.text == llm.tokenizer.decode(base.token_ids[:k])
    kept = gen(llm, "hello world", max_tokens=20, stop_token_ids=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == llm.tokenizer.decode(base.token_ids[: k + 1])
