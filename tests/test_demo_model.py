"""The shipped, trained demo model: it answers, retrieves with its sparse attention, thinks and calls tools.

Every check runs the checkpoint that `dsaserve serve` uses with no model argument, greedily, on
questions generated with seeds the training never drew from (the trainer's seed is 1234).
"""

import json
import random

import pytest

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import GREETING_REPLY, WEATHER_TOOL, codes, distinct_keys, document, question
from server_process import ServerProcess

GREEDY = SamplingParams(temperature=0, max_tokens=40)
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(demo_model_dir(), dtype="float32", max_model_len=4096, progress=False)


@pytest.fixture(scope="module")
def demo_server():
    server = ServerProcess(demo_model_dir(), "--max-model-len", "2048", "--served-model-name", "dsaserve-demo")
    yield server.wait_ready()
    server.stop()


def retrieval_prompt(seed: int, n_filler: int, n_facts: int) -> tuple[str, dict[str, str]]:
    rng = random.Random(seed)
    facts = dict(zip(distinct_keys(rng, n_facts), codes(rng, n_facts)))
    return f"Read the document and answer.\n\n{document(rng, facts, n_filler)}\n\n", facts


def test_reverses_and_sorts_words(demo_llm):
    asked = {"Reverse these words: pine river lotus": "lotus river pine",
             "Sort these words: pine river lotus comet": "comet lotus pine river"}
    outputs = demo_llm.chat([[{"role": "user", "content": q}] for q in asked], GREEDY,
                            chat_template_kwargs=NO_THINKING, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == list(asked.values())


def test_mtp_layer_loads_and_its_drafts_are_accepted(demo_llm):
    spec = LLM(demo_model_dir(), dtype="float32", max_model_len=4096, progress=False,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    conversation = [{"role": "user", "content": "Reverse these words: pine river lotus"}]
    plain = demo_llm.chat(conversation, GREEDY, chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0].text
    drafted = spec.chat(conversation, GREEDY, chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0].text
    assert drafted == plain == "lotus river pine"
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0


def weather_request(stream: bool) -> dict:
    return dict(model="dsaserve-demo", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER_TOOL], max_tokens=80, temperature=0, stream=stream)


def test_tool_call_through_the_openai_client(demo_server):
    from openai import OpenAI

    client = OpenAI(base_url=demo_server.url + "/v1", api_key="none")
    message = client.chat.completions.create(**weather_request(stream=False)).choices[0]
    assert message.finish_reason == "tool_calls"
    (call,) = message.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}  # (the model does not always copy the city right)
    assert message.message.reasoning_content  # thinking is on by default

    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**weather_request(stream=True)):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert (name, set(json.loads(arguments)), finish) == ("get_weather", {"city"}, "tool_calls")


def test_thinking_returns_reasoning_content(demo_server):
    from openai import OpenAI

    client = OpenAI(base_url=demo_server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="dsaserve-demo", max_tokens=80, temperature=0,
                                           messages=[{"role": "user", "content": "Hello!"}])
    message = reply.choices[0].message
    assert message.reasoning_content.startswith("The user greets me")
    assert message.content == GREETING_REPLY


def test_matches_the_reference_up_to_top_k_ties():
    """The trained weights keep parity with transformers on a prompt of ~5 × index_topk tokens: every full
    layer's top-k set agrees except among tokens tied at the k-th score, and log-probs agree up to the
    first position where such a tie was broken differently.

    The trained indexer (relu heads) scores many tokens exactly 0 in its first layer, so ties at the
    boundary are common; transformers' torch.topk kept the later tokens where dsaserve's running top-k
    keeps the earlier ones (docs/design-notes.md)."""
    from reference import (ForwardResult, dsaserve_forward, load_reference, reference_forward,
                           reference_index_scores, untied_topk_mismatch)

    path = demo_model_dir()
    ref = load_reference(path)
    doc, facts = retrieval_prompt(seed=11, n_filler=28, n_facts=3)
    llm_tokenizer = LLM(path, progress=False).tokenizer
    ids = llm_tokenizer.encode(f"[gMASK]<sop><|user|>\n{doc}{question(next(iter(facts)))}<|assistant|></think>",
                               add_special_tokens=False)
    k = ref.config.index_topk
    assert len(ids) > 4 * k
    ours, expected = dsaserve_forward(path, ids), reference_forward(ref, ids)
    first_layer = min(expected.topk)
    first_only = ForwardResult(ours.logprobs, {first_layer: ours.topk[first_layer]})
    assert untied_topk_mismatch(first_only, ForwardResult(expected.logprobs, {first_layer: expected.topk[first_layer]}),
                                reference_index_scores(ref, ids), k) is None
    first_tie = min(t for t, (a, b) in enumerate(zip(ours.topk[first_layer], expected.topk[first_layer])) if a != b)
    assert first_tie > k  # the indexer pruned before it
    for layer in expected.topk:
        assert ours.topk[layer][:first_tie] == expected.topk[layer][:first_tie]
    assert (ours.logprobs[:first_tie] - expected.logprobs[:first_tie]).abs().max().item() < 1e-4
