"""Synthetic chats the demo model is trained on, generated from a seed (nothing is downloaded).

Each task returns a `Chat`: OpenAI-style messages (assistant turns carry `reasoning_content` when
thinking is on), the declared tools, and whether thinking is on. The trainer renders chats with the
demo's own chat template, so what the model learns is exactly what the server sends it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

ADJECTIVES = (
    "amber azure bold brave bright calm clever cold coral crimson dark eager fast fierce gentle golden green "
    "grey happy hidden icy jade keen kind little lucky lunar misty noble olive pale proud quiet rapid red "
    "royal rusty scarlet silent silver solar steady swift tall tiny velvet violet wild").split()
NOUNS = (
    "falcon river tiger otter maple comet harbor lantern meadow canyon badger willow ember glacier heron "
    "island jaguar kettle lotus marble nebula orchid panther quartz raven salmon thistle tundra valley "
    "walrus zephyr beacon cedar dolphin forest garnet hornet iris juniper koala lynx magpie nutmeg oyster "
    "pebble pine rocket sparrow").split()
CITIES = (
    "Paris Berlin Tokyo Madrid Rome Oslo Cairo Lima Seoul Dublin Vienna Prague Lisbon Athens Warsaw Delhi "
    "Sydney Toronto Boston Chicago Nairobi Bangkok Havana Quito Helsinki Zurich Munich Milan Osaka Denver").split()
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
FILLER_SUBJECTS = ("The farmer", "A traveler", "The old clock", "My neighbor", "The small boat", "A young cat",
                   "The teacher", "The wind", "A quiet town", "The baker", "The train", "Her brother")
FILLER_VERBS = ("walked past", "looked at", "waited near", "talked about", "painted", "carried", "found",
                "cleaned", "watched", "remembered", "followed", "visited")
FILLER_OBJECTS = ("the long road", "a wooden bridge", "the market", "an empty house", "the blue door",
                  "a pile of books", "the garden wall", "the station", "a warm bowl of soup", "the hills",
                  "an open window", "the evening sky")
FILLER_TAILS = ("in the morning", "after lunch", "for a while", "without a word", "again", "before the rain",
                "at night", "with great care", "every day", "on Sunday")

GREETING_REPLY = ("Hello! I am the dsaserve demo model. I can find codes in a document, add and subtract "
                  "small numbers, reverse or repeat words, and check the weather with a tool.")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


@dataclass
class Chat:
    messages: list[dict]
    tools: list[dict] | None = None
    thinking: bool = True
    kind: str = ""
    answers: list[str] = field(default_factory=list)  # the expected final answers (for evaluation)
    history: int = 0  # leading messages that are context only (a client's earlier turns), not trained


def assistant(content: str, reasoning: str, thinking: bool, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if thinking:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def key_name(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def filler_sentence(rng: random.Random) -> str:
    return (f"{rng.choice(FILLER_SUBJECTS)} {rng.choice(FILLER_VERBS)} "
            f"{rng.choice(FILLER_OBJECTS)} {rng.choice(FILLER_TAILS)}.")


def fact_sentence(key: str, code: str) -> str:
    return f"The code for {key} is {code}."


def question(key: str) -> str:
    return f"What is the code for {key}?"


def document(rng: random.Random, facts: dict[str, str], n_filler: int, needle_at: dict[str, float] | None = None
             ) -> str:
    """Filler sentences with the facts placed among them (at random, or at given fractions of the text)."""
    sentences = [filler_sentence(rng) for _ in range(n_filler)]
    for key, code in facts.items():
        where = needle_at[key] if needle_at and key in needle_at else rng.random()
        sentences.insert(round(where * len(sentences)), fact_sentence(key, code))
    return " ".join(sentences)


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = key_name(rng)
        if key not in keys:
            keys.append(key)
    return keys


def codes(rng: random.Random, count: int) -> list[str]:
    """Four-digit codes whose first two digits differ within a document (at most 90 codes)."""
    return [f"{head}{rng.randrange(100):02d}" for head in rng.sample(range(10, 100), count)]


def retrieval_chat(rng: random.Random, n_filler: int, n_facts: int, n_questions: int) -> Chat:
    keys = distinct_keys(rng, n_facts)
    facts = dict(zip(keys, codes(rng, n_facts)))
    thinking = rng.random() < 0.5
    doc = document(rng, facts, n_filler)
    asked = rng.sample(keys, min(n_questions, len(keys)))
    messages = [{"role": "user", "content": f"Read the document and answer.\n\n{doc}\n\n{question(asked[0])}"}]
    answers = []
    for i, key in enumerate(asked):
        if i:
            messages.append({"role": "user", "content": question(key)})
        answer = fact_sentence(key, facts[key])
        messages.append(assistant(answer, f"The user asks for the code for {key}. I look for {key} in the document.",
                                  thinking))
        answers.append(answer)
    return Chat(messages, thinking=thinking, kind="retrieval", answers=answers)


def arithmetic_chat(rng: random.Random, thinking: bool | None = None) -> Chat:
    a, b = rng.randrange(0, 21), rng.randrange(0, 21)
    if rng.random() < 0.5:
        text, value = f"{a} + {b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        text, value = f"{a} - {b}", a - b
    ask = rng.choice(("What is {}?", "Compute {}.", "How much is {}?", "{} = ?"))
    thinking = rng.random() < 0.5 if thinking is None else thinking
    answer = f"{text} = {value}."
    return Chat([{"role": "user", "content": ask.format(text)},
                 assistant(answer, f"The user wants {text}. I add or subtract the numbers.", thinking)],
                thinking=thinking, kind="arithmetic", answers=[answer])


def words_chat(rng: random.Random, kind: str | None = None, thinking: bool | None = None) -> Chat:
    """A word list to reverse, sort or repeat (kind; drawn when None)."""
    words = rng.sample(NOUNS, rng.randrange(3, 9))
    kind = kind or rng.choice(("reverse", "sort", "repeat"))
    if kind == "reverse":
        ask, result = "Reverse these words: {}", list(reversed(words))
    elif kind == "sort":
        ask, result = "Sort these words: {}", sorted(words)
    else:
        ask, result = "Repeat after me: {}", words
    thinking = rng.random() < 0.5 if thinking is None else thinking
    answer = " ".join(result)
    reasoning = f"The user wants me to {kind} {len(words)} words."
    return Chat([{"role": "user", "content": ask.format(" ".join(words))}, assistant(answer, reasoning, thinking)],
                thinking=thinking, kind=kind, answers=[answer])


def greeting_chat(rng: random.Random, thinking: bool | None = None) -> Chat:
    ask = rng.choice(("Hello!", "Hi!", "Hello", "Hi there!", "Who are you?", "What can you do?", "Hey!"))
    thinking = rng.random() < 0.5 if thinking is None else thinking
    return Chat([{"role": "user", "content": ask},
                 assistant(GREETING_REPLY, "The user greets me. I say who I am and what I can do.", thinking)],
                thinking=thinking, kind="greeting", answers=[GREETING_REPLY])


def tool_call(name: str, city: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"city": city}}}


def weather_chat(rng: random.Random) -> Chat:
    """A request that needs a declared tool: the call, then (sometimes) the tool's result and the reply."""
    city = rng.choice(CITIES)
    tools = rng.choice(([WEATHER_TOOL], [WEATHER_TOOL, TIME_TOOL], [TIME_TOOL, WEATHER_TOOL]))
    wants_time = any(t["function"]["name"] == "get_time" for t in tools) and rng.random() < 0.4
    name = "get_time" if wants_time else "get_weather"
    ask = (rng.choice(("What time is it in {}?", "What is the time in {}?")) if wants_time else
           rng.choice(("What is the weather in {}?", "How is the weather in {}?", "Is it raining in {}?",
                       "Weather in {} please.")))
    thinking = rng.random() < 0.5
    messages = [{"role": "user", "content": ask.format(city)},
                assistant("", f"The user wants the {'time' if wants_time else 'weather'} in {city}. I call {name}.",
                          thinking, [tool_call(name, city)])]
    if rng.random() < 0.6:
        if wants_time:
            result = {"city": city, "time": f"{rng.randrange(0, 24):02d}:{rng.randrange(0, 60):02d}"}
            reply = f"It is {result['time']} in {city}."
        else:
            result = {"city": city, "temperature": rng.randrange(-10, 36), "condition": rng.choice(CONDITIONS)}
            reply = f"It is {result['condition']} and {result['temperature']} degrees in {city}."
        messages.append({"role": "tool", "content": json.dumps(result)})
        messages.append(assistant(reply, "The tool answered. I tell the user.", thinking))
    return Chat(messages, tools=tools, thinking=thinking, kind="tool")


def tools_declared_but_unused(rng: random.Random) -> Chat:
    chat = rng.choice((arithmetic_chat, words_chat, greeting_chat))(rng)
    chat.tools = [WEATHER_TOOL]
    return chat


SHORT_TASKS = ((arithmetic_chat, 4), (words_chat, 4), (greeting_chat, 1))
TOOL_TASKS = ((weather_chat, 3), (tools_declared_but_unused, 1))


def short_chat(rng: random.Random, with_tools: bool | None = None) -> Chat:
    """A short chat; with_tools picks one that declares tools (True), one that does not (False), or either."""
    if with_tools is None:
        with_tools = rng.random() < 0.3
    tasks, weights = zip(*(TOOL_TASKS if with_tools else SHORT_TASKS))
    return rng.choices(tasks, weights)[0](rng)


def conversation(rng: random.Random) -> Chat:
    """Two or three short chats in one conversation, as a chat page or an OpenAI client sends it: the earlier
    replies as plain content (clients do not send reasoning back) and context only; the last one is trained, with
    its reasoning when thinking is on."""
    thinking = rng.random() < 0.5
    tasks, weights = zip(*SHORT_TASKS)
    chats = [rng.choices(tasks, weights)[0](rng, thinking=thinking) for _ in range(rng.choice((2, 3)))]
    earlier = []
    for chat in chats[:-1]:
        earlier += [chat.messages[0], {"role": "assistant", "content": chat.messages[1]["content"]}]
    last = chats[-1]
    return Chat(earlier + last.messages, thinking=thinking, kind=last.kind, answers=last.answers, history=len(earlier))


def tokenizer_corpus(seed: int = 0, chats: int = 400) -> list[str]:
    """Text the demo tokenizer's BPE is trained on: every word the tasks use, in their contexts."""
    rng = random.Random(seed)
    lines = [" ".join(ADJECTIVES), " ".join(NOUNS), " ".join(CITIES), GREETING_REPLY,
             json.dumps(WEATHER_TOOL), json.dumps(TIME_TOOL)]
    for n in range(100):  # every number piece, alone, after a space, after " is", zero-padded
        lines += [f"{n}", f"x {n}", f"x is {n}", f"{n:02d}", f"x {n:02d}"]
    for _ in range(chats):
        chat = retrieval_chat(rng, 6, 3, 2) if rng.random() < 0.3 else short_chat(rng)
        for m in chat.messages:
            lines.extend(filter(None, (m.get("content"), m.get("reasoning_content"))))
    return lines
