"""What the trained demo model can do: greedy accuracy per task on chats the training never drew.

    python benchmarks/demo_skills.py [--model DIR] [--backend sparse|dense|page] [--seed 555]

Thinking off, exact match against the task's own answer: 40 arithmetic chats, 45 word-list chats
(reverse, sort or repeat), 20 weather questions with the weather tool declared (is the tool called,
and with the asked city), and retrieval over 5 documents of six facts each at about 1K and 2K
tokens (the training saw documents of up to 1,280 tokens); last, the final reply of 30 conversations of two
or three short chats (the earlier replies sent back as content, as clients do). Defaults to the shipped
checkpoint.
"""

from __future__ import annotations

import argparse
import random

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import (
    CITIES,
    WEATHER_TOOL,
    Chat,
    arithmetic_chat,
    codes,
    conversation,
    distinct_keys,
    document,
    fact_sentence,
    question,
    words_chat,
)

GREEDY = SamplingParams(temperature=0, max_tokens=40)
NO_THINKING = {"enable_thinking": False}


def accuracy(llm: LLM, chats: list[Chat]) -> tuple[float, list[str]]:
    """The share answered exactly, and up to three wrong replies."""
    outputs = llm.chat([chat.messages[:-1] for chat in chats], GREEDY, chat_template_kwargs=NO_THINKING, use_tqdm=False)
    replies = [o.outputs[0].text for o in outputs]
    wrong = [f"{chat.messages[0]['content'][-48:]!r} -> {reply!r}" for chat, reply in zip(chats, replies)
             if reply != chat.answers[0]]
    return 1 - len(wrong) / len(chats), wrong[:3]


def retrieval_accuracy(llm: LLM, n_filler: int, seed: int, documents: int = 5) -> tuple[float, int]:
    """The share of six questions per document answered with the fact's sentence, and the last document's tokens."""
    right = total = tokens = 0
    for d in range(documents):
        rng = random.Random(seed * 1000 + d)
        facts = dict(zip(distinct_keys(rng, 6), codes(rng, 6)))
        doc = f"Read the document and answer.\n\n{document(rng, facts, n_filler)}\n\n"
        outputs = llm.chat([[{"role": "user", "content": doc + question(key)}] for key in facts], GREEDY,
                           chat_template_kwargs=NO_THINKING, use_tqdm=False)
        right += sum(o.outputs[0].text == fact_sentence(k, v) for o, (k, v) in zip(outputs, facts.items()))
        total += len(facts)
        tokens = len(llm.tokenizer.encode(doc, add_special_tokens=False))
    return right / total, tokens


def tool_city_accuracy(llm: LLM, rng: random.Random, asks: int = 20) -> tuple[float, float]:
    """Weather questions with the weather tool declared: the share answered with a tool call, and the share
    whose call names the asked city."""
    cities = [rng.choice(CITIES) for _ in range(asks)]
    outputs = llm.chat([[{"role": "user", "content": f"What is the weather in {city}?"}] for city in cities], GREEDY,
                       tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING, use_tqdm=False)
    replies = [o.outputs[0].text for o in outputs]
    calls = ["<tool_call>" in reply for reply in replies]
    right = [call and f">{city}<" in reply for call, city, reply in zip(calls, cities, replies)]
    return sum(calls) / asks, sum(right) / asks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo)")
    parser.add_argument("--backend", default="sparse", choices=("sparse", "dense", "page"))
    parser.add_argument("--seed", type=int, default=555)
    args = parser.parse_args()
    llm = LLM(args.model or demo_model_dir(), dtype="float32", max_model_len=4096, progress=False,
              attention_backend=args.backend)
    rng = random.Random(args.seed)
    rows = [("arithmetic", [arithmetic_chat(rng) for _ in range(40)])]
    words: dict[str, list[Chat]] = {}
    for _ in range(45):
        chat = words_chat(rng)
        words.setdefault(chat.kind, []).append(chat)
    rows += sorted(words.items())
    for name, chats in rows:
        share, wrong = accuracy(llm, chats)
        print(f"{name:10s} {share:6.1%} of {len(chats)}" + (f"   e.g. {wrong[0]}" if wrong else ""))
    called, right_city = tool_city_accuracy(llm, rng)
    print(f"tool call  {called:6.1%} of 20 weather questions call the tool, {right_city:.1%} with the asked city")
    for n_filler in (95, 190):
        share, tokens = retrieval_accuracy(llm, n_filler, args.seed)
        print(f"retrieval  {share:6.1%} of 30 at ~{tokens} tokens")
    followups = [conversation(rng) for _ in range(30)]
    share, wrong = accuracy(llm, followups)
    print(f"follow-up  {share:6.1%} of 30 conversations' last replies" + (f"   e.g. {wrong[0]}" if wrong else ""))


if __name__ == "__main__":
    main()
