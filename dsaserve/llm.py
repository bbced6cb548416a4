"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from dsaserve.chat_format import chat_format
from dsaserve.demo import demo_model_dir
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.outputs import RequestOutput
from dsaserve.sampling_params import SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """Load a glm_moe_dsa checkpoint directory (or the built-in demo model when `model` is None).
    Keyword arguments are EngineArgs fields (the CLI flags' names)."""

    def __init__(self, model: str | None = None, **engine_args):
        if model is None:
            model = demo_model_dir()
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel LLM (also done at exit; nothing to do on one device)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Returns one RequestOutput per prompt, in order. A prompt is a string, {"prompt": str},
        {"prompt_token_ids": [...]}, or (with `prompt_token_ids=`) a list of token ids."""
        items = _normalize_prompts(prompts, prompt_token_ids)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(items)} prompts; give one or one each")
        ids = []
        try:
            for item, p in zip(items, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, item, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (or `chat_template`, jinja source; a
        DeepSeek-V3.2 checkpoint without one: its own encoding), then generate."""
        template = chat_format(self.tokenizer, self.engine.config.family, chat_template)
        if template is None:
            raise ValueError("this checkpoint has no chat template; pass chat_template=")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                template.render(c, tools=tools, add_generation_prompt=add_generation_prompt,
                                **(chat_template_kwargs or {})),
                add_special_tokens=False)
            for c in conversations
        ]
        return self.generate(prompt_token_ids=prompts, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id in results:
                        results[delta.request_id].add(delta)
                    else:
                        results[delta.request_id] = delta
                    if delta.finished:
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _normalize_prompts(prompts, prompt_token_ids) -> list[str | list[int]]:
    if prompt_token_ids is not None:
        if prompts is not None:
            raise ValueError("pass either prompts or prompt_token_ids, not both")
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            return [list(prompt_token_ids)]
        return [list(p) for p in prompt_token_ids]
    if prompts is None:
        raise ValueError("no prompts given")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            out.append(list(p["prompt_token_ids"]))
        elif isinstance(p, dict) and "prompt" in p:
            out.append(p["prompt"])
        else:
            raise ValueError(
                f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {p!r}")
    return out
