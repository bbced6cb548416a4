"""The shipped, trained demo model: it retrieves with its sparse attention, computes, thinks and calls tools.

Every check runs the checkpoint that `dsaserve serve` uses with no model argument, greedily, on
questions generated with seeds the training never drew from (the trainer's seed is 1234).
"""

import json
import random

import pytest
from server_process import ServerProcess

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import (
    GREETING_REPLY,
    WEATHER_TOOL,
    arithmetic_chat,
    codes,
    distinct_keys,
    document,
    fact_sentence,
    question,
    words_chat,
)

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


def test_looks_codes_up_in_1k_token_documents_with_sparse_attention(demo_llm):
    """Six facts in ~1K tokens of filler, 16 times the demo's index_topk: each answer needs the asked fact's
    tokens among the 64 that the indexer selects (the LLM's default backend is sparse). Six documents, 36
    questions, same-noun keys among them; at least 33 right. The shipped model gets 36, the one before it 34
    (`dark-thistle` answered with `tiny-thistle`'s code), the first one none (docs/benchmarks.md)."""
    right, answers = 0, []
    for seed in range(21, 27):
        doc, facts = retrieval_prompt(seed=seed, n_filler=95, n_facts=6)
        assert 900 < len(demo_llm.tokenizer.encode(doc, add_special_tokens=False)) < 1100
        outputs = demo_llm.chat([[{"role": "user", "content": doc + question(key)}] for key in facts], GREEDY,
                                chat_template_kwargs=NO_THINKING, use_tqdm=False)
        answers += [o.outputs[0].text for o in outputs]
        right += sum(o.outputs[0].text == fact_sentence(key, code) for o, (key, code) in zip(outputs, facts.items()))
    assert right >= 33, answers


def test_adds_and_subtracts_small_numbers(demo_llm):
    """Most small sums and differences come out right: at least 12 of these 20. The shipped model gets 12 (75%
    of 40 in benchmarks/demo_skills.py); the bar was 14 for the model before it (78%), which the first model
    shipped (50%) failed."""
    rng = random.Random(2026)
    chats = [arithmetic_chat(rng) for _ in range(20)]
    outputs = demo_llm.chat([chat.messages[:1] for chat in chats], GREEDY, chat_template_kwargs=NO_THINKING,
                            use_tqdm=False)
    right = sum(o.outputs[0].text == chat.answers[0] for o, chat in zip(outputs, chats))
    assert right >= 12, [o.outputs[0].text for o in outputs]


def test_repeats_word_lists(demo_llm):
    rng = random.Random(2027)
    chats = [chat for chat in (words_chat(rng) for _ in range(12)) if chat.kind == "repeat"][:3]
    outputs = demo_llm.chat([chat.messages[:1] for chat in chats], GREEDY, chat_template_kwargs=NO_THINKING,
                            use_tqdm=False)
    assert len(chats) == 3 and [o.outputs[0].text for o in outputs] == [chat.answers[0] for chat in chats]


def word_lists_right(demo_llm, kind: str, seed: int, n: int) -> tuple[int, list[str]]:
    rng = random.Random(seed)
    chats = [words_chat(rng, kind) for _ in range(n)]
    outputs = demo_llm.chat([chat.messages[:1] for chat in chats], GREEDY, chat_template_kwargs=NO_THINKING,
                            use_tqdm=False)
    replies = [o.outputs[0].text for o in outputs]
    return sum(reply == chat.answers[0] for reply, chat in zip(replies, chats)), replies


def test_reverses_word_lists(demo_llm):
    """Lists of three to eight words, reversed whole: the shipped model gets 10 of these 12, the model shipped
    before it none (docs/benchmarks.md, "Teaching reversal")."""
    right, replies = word_lists_right(demo_llm, "reverse", seed=2028, n=12)
    assert right >= 8, replies


def test_mtp_layer_loads_and_its_drafts_are_accepted(demo_llm):
    spec = LLM(demo_model_dir(), dtype="float32", max_model_len=4096, progress=False,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    messages = [{"role": "user", "content": "Repeat after me: pine river lotus comet"}]
    plain = demo_llm.chat(messages, GREEDY, chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0].text
    drafted = spec.chat(messages, GREEDY, chat_template_kwargs=NO_THINKING, use_tqdm=False)[0].outputs[0].text
    assert drafted == plain == "pine river lotus comet"
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0


def test_calls_the_weather_tool_for_the_city_asked(demo_llm):
    """The call spells the city in other tokens than the question (`ĠMunich` asked, `M` `uni` `ch` called): the
    model shipped before called every weather tool for Zurich."""
    cities = ("Munich", "Lima", "Oslo", "Berlin", "Havana", "Osaka", "Seoul", "Quito")
    for thinking in (False, True):
        outputs = demo_llm.chat([[{"role": "user", "content": f"What is the weather in {city}?"}] for city in cities],
                                GREEDY, tools=[WEATHER_TOOL], chat_template_kwargs={"enable_thinking": thinking},
                                use_tqdm=False)
        calls = [o.outputs[0].text.split("<tool_call>")[-1] for o in outputs]
        assert calls == [f"get_weather<arg_key>city</arg_key><arg_value>{city}</arg_value></tool_call>"
                         for city in cities]


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
    assert json.loads(call.function.arguments) == {"city": "Paris"}
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
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")


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

    A trained indexer (relu heads) can score many tokens exactly 0, so ties at the boundary occur:
    transformers' torch.topk keeps other tokens among them than dsaserve's running top-k, which keeps the
    earlier ones (docs/architecture.md#top-k-ties); so do scores within fp32 rounding of each other, which two summation
    orders rank either way. In the shipped model one occurs in its second full layer (1.4e-6 apart). A tie
    broken differently at layer l, position t changes what deeper layers see from position t on, so
    those are compared only before t."""
    from reference import (
        ForwardResult,
        dsaserve_forward,
        load_reference,
        reference_forward,
        reference_index_scores,
        untied_topk_mismatch,
    )

    path = demo_model_dir()
    ref = load_reference(path)
    doc, facts = retrieval_prompt(seed=11, n_filler=28, n_facts=3)
    llm_tokenizer = LLM(path, progress=False).tokenizer
    ids = llm_tokenizer.encode(f"[gMASK]<sop><|user|>\n{doc}{question(next(iter(facts)))}<|assistant|></think>",
                               add_special_tokens=False)
    k = ref.config.index_topk
    assert len(ids) > 4 * k
    ours, expected = dsaserve_forward(path, ids), reference_forward(ref, ids)
    layers = sorted(expected.topk)  # in depth order
    differing = {layer: [t for t, (a, b) in enumerate(zip(ours.topk[layer], expected.topk[layer])) if a != b]
                 for layer in layers}
    first_layer = next((layer for layer in layers if differing[layer]), None)
    first_tie = min((d[0] for d in differing.values() if d), default=len(ids))
    assert first_tie > k  # the indexers pruned before it

    def comparable(result: ForwardResult) -> ForwardResult:
        return ForwardResult(result.logprobs, {layer: result.topk[layer] if first_layer is None or layer <= first_layer
                                               else result.topk[layer][:first_tie] for layer in layers})

    assert untied_topk_mismatch(comparable(ours), comparable(expected), reference_index_scores(ref, ids), k) is None
    assert (ours.logprobs[:first_tie] - expected.logprobs[:first_tie]).abs().max().item() < 1e-4
