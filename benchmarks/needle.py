"""Needle retrieval on the trained demo model: accuracy per context length and attention backend, and
the indexer's recall of the needle.

    python benchmarks/needle.py [--lengths 1024,2048,4096,8192,16384] [--docs 4] [--questions 25]
                                [--backends sparse,dense,page] [--indexer-cache-dtype auto|model|int8|fp8]
                                [--plot docs/needle.png] [--output-json F]

Each length gets `docs` documents of filler with `questions` facts ("The code for amber-falcon is
4821.") placed so that, over all documents, the questions' facts sit at evenly spread depths. Every
question is a chat with thinking off, answered greedily; it counts as right when the reply names the
key's code. Questions about one document share its prefix, so the document is prefilled once.

Recall: with the sparse backend, each question is sent again with the answer forced up to the code
("…The code for amber-falcon"); at the last prompt token, the query that writes the code's first
token, the fraction of the code's two tokens (" is 48", "21" in the demo tokenizer) in each full
layer's top-k, per layer and averaged over the full layers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from contextlib import contextmanager

from dsaserve import LLM, SamplingParams
from dsaserve.attention.indexer_cache import INDEXER_CACHE_DTYPES
from dsaserve.chat_template import ChatTemplate
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import codes, distinct_keys, document, question

HEADER = "Read the document and answer.\n\n"


def build_documents(tokenizer, length: int, docs: int, questions: int) -> list[tuple[str, dict[str, str]]]:
    """Documents of about `length` tokens; the facts of document d sit at depths (j·docs + d + ½)/(docs·questions)."""
    out = []
    for d in range(docs):
        rng = random.Random(100_000 + 97 * length + d)
        keys = distinct_keys(rng, questions)
        facts = dict(zip(keys, codes(rng, questions)))
        depths = {k: (j * docs + d + 0.5) / (docs * questions) for j, k in enumerate(keys)}
        n_filler = max(1, (length - 12 * questions) // 10)
        for _ in range(3):  # rescale the filler count toward the target token count
            text = document(random.Random(rng.random()), facts, n_filler, needle_at=depths)
            tokens = len(tokenizer.encode(text, add_special_tokens=False))
            n_filler = max(1, round(n_filler * (length - 100) / tokens))  # room for the question and answer
        out.append((text, facts))
    return out


def chat_prompt(template: ChatTemplate, doc: str, key: str) -> str:
    messages = [{"role": "user", "content": f"{HEADER}{doc}\n\n{question(key)}"}]
    return template.render(messages, add_generation_prompt=True, enable_thinking=False)


def answer_accuracy(llm: LLM, prompts: list[str], expected: list[str], per_doc: int) -> tuple[float, list[str]]:
    """Greedy replies; the first question of each document runs first so the rest hit its cached prefix."""
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    firsts = list(range(0, len(ids), per_doc))
    replies: dict[int, str] = {}
    for batch in (firsts, [i for i in range(len(ids)) if i not in firsts]):
        if batch:
            outputs = llm.generate(prompt_token_ids=[ids[i] for i in batch], sampling_params=params, use_tqdm=False)
            replies.update({i: o.outputs[0].text for i, o in zip(batch, outputs)})
    texts = [replies[i] for i in range(len(ids))]
    right = [e in t for e, t in zip(expected, texts)]
    return sum(right) / len(right), texts


@contextmanager
def captured_topk(llm: LLM):
    """The top-k rows each full layer of the main model selects during the steps run inside."""
    model = llm.engine.model
    captured: dict[int, object] = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda module, args, out, i=i: captured.__setitem__(i, out.clone()))
        for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def find(sequence: list[int], part: list[int]) -> int:
    for start in range(len(sequence) - len(part), -1, -1):
        if sequence[start : start + len(part)] == part:
            return start
    raise ValueError("fact not found in the prompt's tokens")


def needle_recall(llm: LLM, prompts: list[str], keys: list[str], codes: list[str]) -> dict[int, float]:
    """Per full layer, the mean share of the code's tokens in the top-k of the query that writes the code."""
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=1)
    recalls: dict[int, list[float]] = {}
    for prompt, key, code in zip(prompts, keys, codes):
        ids = tok.encode(f"{prompt}The code for {key}", add_special_tokens=False)
        fact = tok.encode(f" {key} is {code}", add_special_tokens=False)  # ends " is 48", "21": the code's tokens
        digits = set(range(find(ids, fact) + len(fact) - 2, find(ids, fact) + len(fact)))
        with captured_topk(llm) as captured:
            llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)
        for layer, rows in captured.items():
            recalls.setdefault(layer, []).append(len(digits & set(rows[-1].tolist())) / len(digits))
    return {layer: statistics.mean(values) for layer, values in sorted(recalls.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped demo)")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--questions", type=int, default=25, help="questions per document")
    parser.add_argument("--backends", default="sparse,dense,page")
    parser.add_argument("--indexer-cache-dtype", default="auto", choices=INDEXER_CACHE_DTYPES,
                        help="the indexer keys' cache (as the engine option)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args()
    model = args.model or demo_model_dir()
    lengths = [int(n) for n in args.lengths.split(",")]
    backends = args.backends.split(",")
    from dsaserve.config import ModelConfig

    limit = min(max(lengths) + 512, ModelConfig.from_pretrained(model).max_position_embeddings)
    llms = {b: LLM(model, attention_backend=b, max_model_len=limit, progress=False, kv_cache_memory="2GiB",
                   indexer_cache_dtype=args.indexer_cache_dtype) for b in backends}
    template = ChatTemplate(next(iter(llms.values())).tokenizer.chat_template)
    results = {"accuracy": {b: {} for b in backends}, "recall": {}, "recall_by_layer": {}, "prompt_tokens": {},
               "seconds": {}}
    for length in lengths:
        docs = build_documents(next(iter(llms.values())).tokenizer, length, args.docs, args.questions)
        prompts, expected, keys, codes = [], [], [], []
        for doc, facts in docs:
            for key, code in facts.items():
                prompts.append(chat_prompt(template, doc, key))
                expected.append(f"The code for {key} is {code}.")
                keys.append(key)
                codes.append(code)
        tokens = [len(llms[backends[0]].tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
        results["prompt_tokens"][length] = statistics.mean(tokens)
        for backend, llm in llms.items():
            start = time.perf_counter()
            accuracy, texts = answer_accuracy(llm, prompts, expected, args.questions)
            results["accuracy"][backend][length] = accuracy
            results["seconds"][f"{backend}@{length}"] = time.perf_counter() - start
            print(f"{length:6d} tokens (mean prompt {statistics.mean(tokens):.0f}) {backend:6s} accuracy "
                  f"{accuracy:6.1%} over {len(prompts)} questions  e.g. {texts[0]!r}", flush=True)
        if "sparse" in llms:
            by_layer = needle_recall(llms["sparse"], prompts, keys, codes)
            results["recall"][length] = statistics.mean(by_layer.values())
            results["recall_by_layer"][length] = by_layer
            print(f"{length:6d} tokens: indexer recall of the needle's digits in the top-k "
                  f"{results['recall'][length]:.1%} (" + ", ".join(f"layer {i} {r:.1%}" for i, r in by_layer.items())
                  + ")", flush=True)
    print(json.dumps(results, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, lengths, args.plot)


def plot(results: dict, lengths: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for backend, points in results["accuracy"].items():
        ax.plot(lengths, [100 * points[n] for n in lengths], marker="o", label=f"accuracy, {backend}")
    if results["recall"]:
        ax.plot(lengths, [100 * results["recall"][n] for n in lengths], linestyle="--", marker="x",
                label="indexer recall of the needle, mean of the full layers")
        for layer in results["recall_by_layer"][lengths[0]]:
            ax.plot(lengths, [100 * results["recall_by_layer"][n][layer] for n in lengths], linestyle=":",
                    marker=".", label=f"indexer recall, layer {layer}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    ax.minorticks_off()
    ax.set(xlabel="context tokens", ylabel="%", ylim=(0, 105), title="needle retrieval, trained demo model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
