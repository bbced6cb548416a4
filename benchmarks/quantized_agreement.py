"""How often each weight form gives the unquantized model's greedy tokens, on the trained demo model.

    python benchmarks/quantized_agreement.py

Eight of the demo's chats (thinking on), 128 greedy tokens each past their natural end (eos ignored):
per form, the positions where its token equals the reference's and the length of the identical prefix,
out of 1,024. The reference is the bf16 model through torch's matmuls (the kernels off).
"""

from __future__ import annotations

import dsaserve.quantization.apply as apply
from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir

CHATS = ["Hello!", "reverse: apple banana cherry", "sort: pear fig kiwi apple", "What is 7 + 12?",
         "What is the weather in Paris?", "repeat: blue sky", "Hi, who are you?", "reverse: one two three four"]


def tokens(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    args = dict(block_size=16, progress=False, max_model_len=1024)
    kernels = apply.kernels_here
    apply.kernels_here = lambda device: False
    reference = tokens(LLM(demo_model_dir(), **args))
    apply.kernels_here = kernels
    total = sum(map(len, reference))
    for form in (None, "fp8", "int8", "int4"):
        ours = tokens(LLM(demo_model_dir(), quantization=form, **args))
        same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
        prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, reference))
        print(f"{form or 'bf16 packed':>11}: same token at {same}/{total} positions, identical prefix {prefix}/{total}")


if __name__ == "__main__":
    main()
