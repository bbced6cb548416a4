"""MTP speculative decoding on the trained demo model: acceptance and speed at N = 1, 2, 3 drafts.

    python benchmarks/demo_mtp.py [--prompts 16] [--max-tokens 64] [--batch-sizes 1,16]

The prompts are the demo's own tasks (retrieval over ~300-token documents, arithmetic, word lists,
greetings, weather tool calls), drawn with a seed the training did not use, thinking on, greedy. For
each N it reports the mean accepted length (1 + accepted drafts per verification, vLLM's definition),
the acceptance rate per draft position, and output tokens per second at each batch size against the
same engine settings without speculation. Outputs are checked to be identical to the plain ones.
"""

from __future__ import annotations

import argparse
import random
import time

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import retrieval_chat, short_chat


def prompts(count: int, seed: int = 77) -> list[tuple[list[dict], list[dict] | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chat = retrieval_chat(rng, 25, 4, 1) if i % 4 == 0 else short_chat(rng)
        first_user = next(j for j, m in enumerate(chat.messages) if m["role"] == "user")
        out.append((chat.messages[: first_user + 1], chat.tools))
    return out


def run(llm: LLM, chats, batch: int, max_tokens: int) -> tuple[float, list[str]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(chats), batch):
        outputs = generate_batch(llm, chats[i : i + batch], params)
        texts += [o.outputs[0].text for o in outputs]
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start), texts


def generate_batch(llm: LLM, group, params: SamplingParams):
    """One generate call for the group; each chat is rendered with its own tools."""
    from dsaserve.chat_template import ChatTemplate

    template = ChatTemplate(llm.tokenizer.chat_template, llm.tokenizer.special_tokens)
    ids = [llm.tokenizer.encode(template.render(m, tools=t), add_special_tokens=False) for m, t in group]
    return llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--drafts", default="1,2,3")
    args = parser.parse_args()
    chats = prompts(args.prompts)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    plain = LLM(demo_model_dir(), progress=False)
    base = {b: run(plain, chats, b, args.max_tokens) for b in batches}
    print("no speculation: " + ", ".join(f"batch {b}: {base[b][0]:.1f} tok/s" for b in batches), flush=True)
    for n in [int(x) for x in args.drafts.split(",")]:
        llm = LLM(demo_model_dir(), progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": n})
        speeds = {}
        for b in batches:
            speeds[b], texts = run(llm, chats, b, args.max_tokens)
            assert texts == base[b][1], f"N={n} batch {b}: outputs differ from the plain run"
        stats = llm.engine.stats().spec_decode
        mean_len = 1 + stats.num_accepted_tokens / max(1, stats.num_drafts)
        per_pos = [a / max(1, stats.num_drafts) for a in stats.accepted_per_pos]
        print(f"N={n}: mean accepted length {mean_len:.2f}, acceptance per position "
              f"{', '.join(f'{p:.0%}' for p in per_pos)}; " +
              ", ".join(f"batch {b}: {speeds[b]:.1f} tok/s ({speeds[b] / base[b][0]:.2f}x)" for b in batches), flush=True)


if __name__ == "__main__":
    main()
