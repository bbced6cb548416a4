"""The offline API: prompt formats, stopping, logprobs, limits, and the KV pool coming back whole."""

import math

import pytest
import torch

from dsaserve import LLM, SamplingParams
from dsaserve.engine.admission import RequestRejected
from dsaserve.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, progress=False)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_formats_agree(llm):
    ids = llm.tokenizer.encode("Paris is the capital of")
    as_str = llm.generate("Paris is the capital of", GREEDY, use_tqdm=False)
    as_dict = llm.generate({"prompt": "Paris is the capital of"}, GREEDY, use_tqdm=False)
    as_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    as_kwarg = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    assert texts(as_str) == texts(as_dict) == texts(as_ids) == texts(as_kwarg)
    assert as_str[0].prompt == "Paris is the capital of" and as_str[0].prompt_token_ids == ids
    assert as_str[0].outputs[0].text == llm.tokenizer.decode(as_str[0].outputs[0].token_ids)


def test_outputs_keep_prompt_order_and_finish_by_length(llm):
    outs = llm.generate(["a", "bb bb", "ccc ccc ccc"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["a", "bb bb", "ccc ccc ccc"]
    assert all(o.finished and o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8 for o in outs)


def test_stop_token_ends_generation(llm):
    first = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = first[3]
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == first[: first.index(stop_at) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.config.eos_token_ids
    first = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # Make the model's greedy token an eos id by patching the logits: the engine must stop on it.
    original = llm.engine.model.compute_logits

    def eos_first(hidden):
        logits = original(hidden)
        logits[:, eos[1]] = 1e4
        return logits

    llm.engine.model.compute_logits = eos_first
    try:
        stopped = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        ignored = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.model.compute_logits = original
    assert stopped.token_ids == [eos[1]] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert len(ignored.token_ids) == 8 and first != ignored.token_ids


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate("one two three four", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert all(e.logprob <= 0 for e in entry.values())
    assert math.isclose(completion.cumulative_logprob,
                        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), rel_tol=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) in (2, 3)


def test_prompt_logprobs_equal_across_chunked_prefill(tiny_checkpoint, llm):
    chunked = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, max_num_batched_tokens=5,
                  progress=False)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    text = "the quick brown fox jumps over the lazy dog " * 2
    a = llm.generate(text, params, use_tqdm=False)[0].prompt_logprobs
    b = chunked.generate(text, params, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=42, ignore_eos=True)
    a = llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["hello", "other prompt"], params, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate("hello", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=43, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and a != c


def test_too_long_request_rejected_and_pool_untouched(llm):
    free = llm.engine.stats().num_free_blocks
    with pytest.raises(RequestRejected, match="exceeds max_model_len=512"):
        llm.generate(prompt_token_ids=[5] * 500, sampling_params=SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[10**6], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate(prompt_token_ids=[[1, 2], []], sampling_params=GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_free_blocks == free and not llm.engine.has_unfinished_requests()


def test_blocks_return_to_the_pool(llm):
    free = llm.engine.stats().num_free_blocks
    assert free == llm.engine.stats().num_blocks
    llm.generate(["x" * 40, "y", "z z z"], SamplingParams(max_tokens=20, temperature=0.7), use_tqdm=False)
    assert llm.engine.stats().num_free_blocks == free


def test_max_tokens_none_runs_to_max_model_len(tiny_checkpoint):
    small = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=40, progress=False)
    out = small.generate(prompt_token_ids=[7] * 30, sampling_params=SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(stop_token_ids=["x"]), "stop_token_ids"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_engine_args_validation(tiny_checkpoint):
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        LLM(tiny_checkpoint, attention_backend="flash", progress=False)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(tiny_checkpoint, max_model_len=100000, progress=False)
    with pytest.raises(ValueError, match="kv_cache_memory='lots'"):
        LLM(tiny_checkpoint, kv_cache_memory="lots", progress=False)


def test_kv_cache_memory_sets_the_pool_size(tiny_checkpoint):
    small = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, kv_cache_memory="1MiB",
                progress=False)
    cfg = small.engine.config
    per_block = 16 * 4 * (cfg.num_hidden_layers * cfg.kv_cache_dim + len(cfg.full_layers) * cfg.index_head_dim)
    assert small.engine.stats().num_blocks == (1 << 20) // per_block
    assert small.engine.kv_cache.nbytes() == small.engine.stats().num_blocks * per_block
    with pytest.raises(ValueError, match="max_model_len=512 needs 512 tokens of KV cache but the cache holds 32"):
        LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=512, kv_cache_memory=per_block * 2,
            progress=False)
    fitted = LLM(tiny_checkpoint, dtype="float32", block_size=16, kv_cache_memory=per_block * 2, progress=False)
    assert fitted.engine.max_model_len == 32  # not given: lowered to what the cache holds
    with pytest.raises(RequestRejected, match="exceeds max_model_len=32"):
        fitted.generate(prompt_token_ids=[3] * 40, sampling_params=GREEDY, use_tqdm=False)


def test_bf16_generation_runs(make_checkpoint):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    out = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False).generate(
        "hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_chat_renders_the_template_and_generates(llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = llm.tokenizer.encode("[gMASK]<sop><|user|>\nWhat is 2 + 2?<|assistant|>", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert out.outputs[0].token_ids == llm.generate(prompt_token_ids=expected, sampling_params=GREEDY,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    two = llm.chat([messages, messages], GREEDY, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert len(two) == 2 and two[0].prompt_token_ids == expected + [llm.tokenizer.token_to_id("</think>")]


def test_logit_bias_and_stop_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(RequestRejected, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={-1000000: 5}), use_tqdm=False)
    with pytest.raises(RequestRejected, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**9]), use_tqdm=False)
