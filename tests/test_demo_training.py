"""The demo model's trainer: its forward is the serving model's, its losses train what they should."""

import random

import pytest
import torch

from dsaserve.config import ModelConfig
from dsaserve.demo.checkpoint_builder import save_checkpoint
from dsaserve.demo.tasks import retrieval_chat, weather_chat
from dsaserve.demo.train import ChatEncoder, collate, demo_tokenizer, losses, model_config
from dsaserve.demo.train_model import TrainableGlmMoeDsa


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_hidden_layers=4, index_topk=8,
             indexer_types=["full", "shared", "full", "shared"])


def small_trainable(tokenizer, **overrides) -> tuple[dict, TrainableGlmMoeDsa]:
    raw = model_config(tokenizer, **{**SMALL, **overrides})
    model = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=3)
    with torch.no_grad():  # norms and biases away from their initial values, so each one matters
        g = torch.Generator().manual_seed(4)
        for name in model.names:
            if "norm" in name or name.endswith("bias"):
                model.w(name).add_(0.2 * torch.randn(model.w(name).shape, generator=g))
    return raw, model


def test_encoder_trains_exactly_the_assistant_turns_and_their_stop_tokens(tokenizer):
    encoder = ChatEncoder(tokenizer)
    rng = random.Random(0)
    chat = weather_chat(rng)
    while len(chat.messages) < 4:  # a call, the tool's answer, then the reply
        chat = weather_chat(rng)
    example = encoder.encode(chat)
    trained = [i for i, t in zip(example.ids, example.target) if t]
    text = tokenizer.decode(trained, skip_special_tokens=False)
    call, reply = chat.messages[1], chat.messages[3]
    city = call["tool_calls"][0]["function"]["arguments"]["city"]
    assert text.count("<|observation|>") == 1 and text.endswith(reply["content"] + "<|user|>")
    assert f"<arg_value>{city}</arg_value></tool_call><|observation|>" in text
    assert chat.messages[0]["content"] not in text and "<tool_response>" not in text
    full = tokenizer.decode(example.ids, skip_special_tokens=False)
    assert full.startswith("[gMASK]<sop><|system|>") and "<tool_response>" in full


def test_training_forward_equals_the_reference_in_sparse_mode(tokenizer, tmp_path):
    """Sparse mode is the serving computation: same logits as transformers, whose indexer prunes to top-k."""
    from reference import load_reference

    raw, model = small_trainable(tokenizer)
    save_checkpoint(str(tmp_path), raw, model.state_dict_for_checkpoint())
    ref = load_reference(str(tmp_path))
    ids = torch.randint(20, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        assert (model(ids, sparse=True).logits - expected).abs().max() < 1e-4
        assert (model(ids, sparse=False).logits - expected).abs().max() > 1e-2  # the top-k really prunes


def test_indexer_learns_only_from_its_kl_and_the_model_only_from_the_language_losses(tokenizer):
    raw, model = small_trainable(tokenizer)
    encoder = ChatEncoder(tokenizer)
    ids, target = collate([encoder.encode(retrieval_chat(random.Random(1), 6, 3, 2))], raw["pad_token_id"])
    for sparse in (False, True):
        parts, _ = losses(model, ids, target, sparse, raw["pad_token_id"])
        indexer = [p for n, p in model.weights.items() if "__indexer__" in n]
        others = [p for n, p in model.weights.items() if "__indexer__" not in n and p.requires_grad]
        kl_grads = torch.autograd.grad(parts["kl"], indexer + others, allow_unused=True)
        assert all(g is not None and g.abs().sum() > 0 for g in kl_grads[: len(indexer)])
        assert all(g is None or g.abs().sum() == 0 for g in kl_grads[len(indexer):])
        lm_grads = torch.autograd.grad(parts["lm"] + parts["mtp"], indexer, allow_unused=True)
        assert all(g is None or g.abs().sum() == 0 for g in lm_grads)


def test_a_few_steps_lower_the_losses_and_write_a_checkpoint_both_engines_load(tokenizer, tmp_path):
    from dsaserve import LLM
    from dsaserve.demo.train import TrainConfig, train
    from reference import dsaserve_forward, load_reference, reference_forward

    tc = TrainConfig(steps=12, dense_steps=6, tokens_per_step=1024, max_doc_tokens=192, save_every=0, warmup=2,
                     chain_steps=3)
    log: list[str] = []
    train(str(tmp_path), tc, log=log.append, config_overrides=SMALL)
    # The same fixed batch scores better under the written weights than under the initial ones.
    from dsaserve.demo.mtp_chain import load_trainable

    raw = model_config(tokenizer, **SMALL)
    initial = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=tc.seed)
    trained, _ = load_trainable(str(tmp_path), tc.seed)
    encoder = ChatEncoder(tokenizer)
    rng = random.Random(99)
    ids, target = collate([encoder.encode(retrieval_chat(rng, 4, 3, 2)) for _ in range(4)], raw["pad_token_id"])
    with torch.no_grad():
        before, after = (losses(m, ids, target, True, raw["pad_token_id"])[0] for m in (initial, trained))
    assert after["lm"] < before["lm"] - 1 and after["mtp"] < before["mtp"] - 1 and after["kl"] < before["kl"]
    llm = LLM(str(tmp_path), dtype="float32", progress=False, speculative_config={"method": "mtp",
                                                                                   "num_speculative_tokens": 1})
    ids = llm.tokenizer.encode("[gMASK]<sop><|user|>\nHello!<|assistant|>", add_special_tokens=False)
    ours, expected = dsaserve_forward(str(tmp_path), ids), reference_forward(load_reference(str(tmp_path)), ids)
    assert (ours.logprobs - expected.logprobs).abs().max() < 1e-4


def test_training_is_deterministic_from_its_seed(tmp_path):
    import hashlib

    from dsaserve.demo.train import TrainConfig, train

    digests = []
    for seed, name in ((5, "a"), (5, "b"), (6, "c")):
        tc = TrainConfig(seed=seed, steps=4, dense_steps=2, tokens_per_step=1024, max_doc_tokens=192, save_every=0,
                         warmup=2, chain_steps=2)
        train(str(tmp_path / name), tc, log=lambda line: None, config_overrides=SMALL)
        digests.append(hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]


def test_chained_draft_steps_equal_the_layer_run_over_a_rounds_rows(tokenizer):
    """The chain's step k at base j is the MTP layer over the rows a draft round has at that point: step-1
    rows 0…j, then this base's draft rows, each fed the previous step's output (written from the formulas)."""
    from dsaserve.demo.mtp_chain import chain_logits
    from dsaserve.demo.train_model import rms

    raw, model = small_trainable(tokenizer)
    cfg, pad, eps = model.cfg, raw["pad_token_id"], model.cfg.rms_norm_eps
    ids, _ = collate([ChatEncoder(tokenizer).encode(retrieval_chat(random.Random(8), 2, 3, 1))], pad)
    ids = ids[:, :40]
    with torch.no_grad():
        ref = model(ids, sparse=False)
        chain = chain_logits(model, ids, ref.final_hidden, pad, 3)
        assert torch.allclose(chain[0][:, :-1], ref.mtp_logits[:, :-1], atol=1e-4)  # (the last row drafts nothing)
        p = f"model.layers.{cfg.num_hidden_layers}"
        embed, lm_head = model.w("model.embed_tokens.weight"), model.w("lm_head.weight")

        def block_input(token: int, prev: torch.Tensor, zero: bool) -> torch.Tensor:
            e = torch.zeros_like(embed[token]) if zero else embed[token]
            return torch.cat([rms(e, model.w(f"{p}.enorm.weight"), eps),
                              rms(prev, model.w(f"{p}.hnorm.weight"), eps)]) @ model.w(f"{p}.eh_proj.weight").T

        def run(rows: list[torch.Tensor]) -> torch.Tensor:
            n = len(rows)
            angles = torch.arange(n)[:, None].float() * model.inv_freq[None]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            out = model.layer(p, torch.stack(rows)[None], angles.cos(), angles.sin(), causal, True, False, [], {}, True)
            return out[0, -1]

        tokens = ids[0].tolist()
        for j in (5, 21, 36):
            rows = [block_input(tokens[i + 1], ref.final_hidden[0, i], i == 0) for i in range(j + 1)]
            prev = run(rows)
            for k in (2, 3):
                rows.append(block_input(tokens[j + k], prev, False))
                prev = run(rows)
                expected = rms(prev, model.w(f"{p}.shared_head.norm.weight"), eps) @ lm_head.T
                assert torch.allclose(chain[k - 1][0, j], expected, atol=1e-4), (j, k)
