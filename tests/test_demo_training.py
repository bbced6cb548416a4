"""The demo model's trainer: its forward is the serving model's, its losses train what they should."""

import math
import random

import pytest
import torch

from dsaserve.config import ModelConfig
from dsaserve.demo.checkpoint_builder import save_checkpoint
from dsaserve.demo.tasks import conversation, retrieval_chat, weather_chat
from dsaserve.demo.train import ChatEncoder, collate, demo_tokenizer, losses, model_config, pointer_index
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


def test_conversations_train_their_last_reply_alone_after_earlier_replies_sent_as_clients_send_them(tokenizer):
    encoder = ChatEncoder(tokenizer)
    rng = random.Random(5)
    chats = [conversation(rng) for _ in range(30)]
    assert {len(c.messages) for c in chats} == {4, 6} and {c.thinking for c in chats} == {True, False}
    for chat in chats:
        earlier, last = chat.messages[:chat.history], chat.messages[-1]
        assert chat.history == len(chat.messages) - 2 and [m["role"] for m in earlier] == ["user", "assistant"] * (
            chat.history // 2)
        assert all("reasoning_content" not in m for m in earlier)  # clients send back the content only
        assert ("reasoning_content" in last) == chat.thinking and chat.answers == [last["content"]]
        example = encoder.encode(chat)
        trained = tokenizer.decode([i for i, t in zip(example.ids, example.target) if t], skip_special_tokens=False)
        reasoning = f"<think>{last['reasoning_content']}</think>" if chat.thinking else ""
        assert trained.replace("\n", "") == reasoning + last["content"] + "<|user|>"
        full = tokenizer.decode(example.ids, skip_special_tokens=False)
        assert all(m["content"] in full for m in earlier)


def test_short_steps_hold_conversations_at_the_configured_share(tokenizer):
    from dsaserve.demo.train import TrainConfig, sample_batch

    encoder, user = ChatEncoder(tokenizer), tokenizer.token_to_id("<|user|>")
    for share, expected in ((0.0, {1}), (1.0, {2, 3})):
        tc = TrainConfig(steps=1, copy_steps=0, copy_share=0.0, mix=(0.0, 0.0, 1.0, 0.0), conversations=share)
        kind, examples = sample_batch(random.Random(3), encoder, 0, tc)
        turns = {sum(i == user for i, t in zip(e.ids, e.target) if not t) for e in examples}  # user turns asked
        assert kind == "short" and turns == expected


def test_code_pointers_lead_from_each_answers_code_token_to_its_copy_in_the_document(tokenizer):
    encoder = ChatEncoder(tokenizer)
    chat = retrieval_chat(random.Random(3), 6, 4, 3)
    example = encoder.encode(chat)
    ids, target = example.ids, example.target
    assert len(example.pointers) == 2 * len(chat.answers)  # " is 48", "21": a code is two tokens
    first_answer = target.index(True)
    for query, key in example.pointers:
        assert target[query + 1] and not target[key] and key < first_answer  # answer token ← the document
        assert ids[query + 1] == ids[key] and ids[query - 2: query + 1] == ids[key - 3: key]
        assert any(c.isdigit() for c in tokenizer.id_to_token(ids[key]))
    keys = [key for _, key in example.pointers]
    read = [tokenizer.decode([ids[a], ids[b]]).split(" is ")[1] for a, b in zip(keys[0::2], keys[1::2])]
    assert read == [a.split(" is ")[1].rstrip(".") for a in chat.answers]


def test_copy_batches_train_the_repeat_and_point_each_repeated_token_at_its_first_copy(tokenizer):
    from dsaserve.demo.train import copy_batch

    encoder = ChatEncoder(tokenizer)
    batch = copy_batch(random.Random(0), encoder.text_tokens, rows=4, segment=8)
    assert len({len(e.ids) for e in batch}) == 1  # one gap per batch: no padding
    special = set(tokenizer.get_added_tokens_decoder())
    for e in batch:
        start = len(e.ids) - 8
        assert e.ids[start:] == e.ids[:8] and not special & set(e.ids)
        assert [i for i, t in enumerate(e.target) if t] == list(range(start + 1, len(e.ids)))
        assert e.pointers == [(start + i - 1, i) for i in range(1, 8)]


def test_call_pointers_lead_from_each_piece_of_the_call_to_the_city_the_user_wrote(tokenizer):
    encoder = ChatEncoder(tokenizer, skill_pointers=True)
    rng = random.Random(0)
    for city in ("Paris", "Munich"):  # one token in the call, and three (`M`, `uni`, `ch`)
        chat = weather_chat(rng)
        while chat.tools[0]["function"]["name"] != "get_weather" or "time" in chat.messages[0]["content"]:
            chat = weather_chat(rng)
        chat.messages[0]["content"] = f"What is the weather in {city}?"
        chat.messages[1]["tool_calls"][0]["function"]["arguments"]["city"] = city
        example = encoder.encode(chat)
        ids, target = example.ids, example.target
        queries = [q for q, _ in example.skill_pointers["call"]]
        pieces = tokenizer.encode(city, add_special_tokens=False).ids
        assert tokenizer.id_to_token(ids[queries[0]]) == "<arg_value>" and target[queries[0]]
        assert [ids[q + 1] for q in queries] == pieces and queries == list(range(queries[0], queries[0] + len(pieces)))
        (key,) = {k for _, k in example.skill_pointers["call"]}
        assert tokenizer.id_to_token(ids[key]) == "Ġ" + city and not target[key]
    assert ChatEncoder(tokenizer).encode(chat).skill_pointers == {}  # the main phase, as it was run, has none


def test_reverse_pointers_lead_to_the_word_just_written_whose_previous_token_comes_next(tokenizer):
    from dsaserve.demo.tasks import words_chat

    encoder = ChatEncoder(tokenizer, skill_pointers=True)
    rng = random.Random(5)
    kinds = set()
    while len(kinds) < 3:
        chat = words_chat(rng)
        kinds.add(chat.kind)
        example = encoder.encode(chat)
        ids, target = example.ids, example.target
        pointers = example.skill_pointers.get("reverse", [])
        if chat.kind != "reverse":
            assert pointers == [] and example.pointers == []
            continue
        words = chat.answers[0].split()
        assert [tokenizer.decode([ids[q + 1]]).strip() for q, _ in pointers] == words[1:]  # each later word, in turn
        for query, key in pointers:
            word = tokenizer.decode([ids[query]]).strip()  # (the answer's first word is bare, the prompt's spaced)
            assert target[query + 1] and not target[key] and tokenizer.decode([ids[key]]).strip() == word
            assert ids[key - 1] == ids[query + 1]


def test_reversal_batches_hold_reversals_alone_within_the_token_budget(tokenizer):
    from dsaserve.demo.train import reversal_batch

    examples = reversal_batch(random.Random(8), ChatEncoder(tokenizer, skill_pointers=True), 2048)
    assert len(examples) > 20 and len(examples) * max(len(e.ids) for e in examples) <= 2048
    assert all("Reverse these words" in tokenizer.decode(e.ids) and e.skill_pointers["reverse"] for e in examples)


def test_the_skills_phase_opens_with_reversals_and_tool_chats_in_turn_then_draws_its_mix(tokenizer):
    from dsaserve.demo.train import SkillsConfig, TrainConfig, skills_batch

    encoder, rng = ChatEncoder(tokenizer, skill_pointers=True), random.Random(9)
    sc = SkillsConfig(opening_steps=6)
    data = TrainConfig(steps=1, dense_steps=0, copy_steps=0, copy_share=0.0, mix=(0.0, 0.0, 1.0, 0.0))
    batches = [skills_batch(rng, encoder, step, sc, data) for step in range(7)]
    # without the tool chats between the reversals, the calls lost their city (docs/benchmarks.md)
    assert [kind for kind, _ in batches] == ["reverse", "tools"] * 3 + ["short"]
    for kind, examples in batches[:6]:
        texts = [tokenizer.decode(e.ids) for e in examples]
        assert all(("Reverse these words" in t) if kind == "reverse" else ("get_weather" in t) for t in texts)


def test_shared_embedding_gives_every_row_one_common_direction(tokenizer):
    cfg = ModelConfig.from_dict(model_config(tokenizer, **SMALL))
    means = [TrainableGlmMoeDsa(cfg, seed=3, shared_embedding=shared).w("model.embed_tokens.weight").mean(0).norm()
             for shared in (False, True)]
    width = cfg.hidden_size ** 0.5  # the norm of one row's random part
    assert means[0] < 0.1 * width and means[1] > 0.5 * width


def test_watched_heads_return_the_attention_their_layer_used(tokenizer, tmp_path):
    """The shared layer 1's head, in sparse mode: the reference's attention weights there, top-k mask included."""
    from reference import load_reference

    raw, model = small_trainable(tokenizer)
    save_checkpoint(str(tmp_path), raw, model.state_dict_for_checkpoint())
    ids = torch.randint(20, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    name = "model.layers.1.self_attn"
    with torch.no_grad():
        out = model(ids, sparse=True, watch_heads=[(name, 1)])
        expected = load_reference(str(tmp_path))(ids, output_attentions=True).attentions[1][:, 1]
    assert list(out.head_attention) == [(name, 1)] and (expected == 0).sum() > 2 * (24 * 25 // 2 - 16 * 8)
    assert torch.allclose(out.head_attention[name, 1], expected, atol=1e-5)


def test_attention_losses_vanish_exactly_when_the_heads_attend_where_they_are_told(tokenizer):
    from dsaserve.demo.train import attention_losses, watched_heads
    from dsaserve.demo.train_model import ForwardOutput

    cfg = ModelConfig.from_dict(model_config(tokenizer, **SMALL))
    s, real = 6, torch.tensor([[True] * 6, [True] * 4 + [False] * 2])  # row 1 ends in padding
    pointers = torch.tensor([[0, 5, 2], [1, 3, 0]])  # (row, query, key)
    previous, back3 = torch.zeros(2, s, s), torch.zeros(2, s, s)
    previous[:, 0, 0], previous[:, torch.arange(1, s), torch.arange(s - 1)] = 1.0, 1.0
    back3[:, :3, 0], back3[:, torch.arange(3, s), torch.arange(s - 3)] = 1.0, 1.0
    lookup = torch.full((2, s, s), 0.5)
    lookup[0, 5, 2] = lookup[1, 3, 0] = 1.0
    previous[1, 5] = torch.tensor([0, 0, 0, 0, 1.0, 0]).roll(1)  # a padded query may look anywhere
    heads = watched_heads(cfg, offsets=(1, 3))
    assert heads.all() == [("model.layers.0.self_attn", 0), ("model.layers.0.self_attn", 2),
                           ("model.layers.1.self_attn", 1)]
    out = ForwardOutput(None, None, None, [], {}, dict(zip(heads.all(), (previous, back3, lookup))))
    parts = attention_losses(out, heads, real, pointers)
    assert parts == {"previous": 0.0, "back3": 0.0, "pointer": 0.0}
    previous[0, 3] = torch.tensor([0, 0, 0.5, 0.5, 0, 0])  # query 3 splits its attention between keys 2 and 3
    back3[0, 4] = torch.tensor([0.5, 0.5, 0, 0, 0, 0])  # query 4 between keys 0 and 1 (its key is 1)
    lookup[1, 3, 0] = 0.25
    parts = attention_losses(out, heads, real, pointers)
    assert parts["previous"].item() == pytest.approx(math.log(2) / 8)  # 8 real queries after the first token
    assert parts["back3"].item() == pytest.approx(math.log(2) / 4)  # 4 real queries from position 3 on
    assert parts["pointer"].item() == pytest.approx(math.log(4) / 2)


def test_each_skill_head_is_trained_on_its_own_pointers(tokenizer):
    from dsaserve.demo.train import SKILL_HEADS, attention_losses, watched_heads
    from dsaserve.demo.train_model import ForwardOutput

    cfg = ModelConfig.from_dict(model_config(tokenizer, **SMALL))
    assert watched_heads(cfg).skills == ()  # watched only when the skill pointers are trained
    heads = watched_heads(cfg, offsets=(1,), skills=True)
    assert [(role, name, head) for role, name, head in heads.skills] == [
        ("call", "model.layers.1.self_attn", SKILL_HEADS["call"]),
        ("reverse", "model.layers.1.self_attn", SKILL_HEADS["reverse"])]
    s, real = 4, torch.ones(1, 4, dtype=torch.bool)
    previous = torch.zeros(1, s, s)
    previous[:, 0, 0], previous[:, torch.arange(1, s), torch.arange(s - 1)] = 1.0, 1.0
    call, reverse = torch.full((1, s, s), 0.5), torch.full((1, s, s), 0.5)
    call[0, 3, 1] = 1.0
    reverse[0, 2, 0] = 0.125
    out = ForwardOutput(None, None, None, [], {},
                        dict(zip(heads.all(), (previous, torch.zeros(1, s, s), call, reverse))))
    parts = attention_losses(out, heads, real, torch.zeros(0, 3, dtype=torch.long),
                             {"call": torch.tensor([[0, 3, 1]]), "reverse": torch.tensor([[0, 2, 0]])})
    assert parts["call_pointer"] == 0.0 and parts["reverse_pointer"].item() == pytest.approx(math.log(8))
    assert "pointer" not in parts  # no lookup pointers in this batch


def test_the_indexer_learns_the_calls_pointed_keys_and_not_the_reversals(tokenizer):
    raw, model = small_trainable(tokenizer)
    ids = torch.randint(20, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    target, none = torch.ones_like(ids, dtype=torch.bool), torch.zeros(0, 3, dtype=torch.long)
    call, reverse = torch.tensor([[0, 20, 3]]), torch.tensor([[0, 12, 5]])

    def index_pointer(skills: dict) -> float:
        with torch.no_grad():
            parts, _ = losses(model, ids, target, True, raw["pad_token_id"], none, (1,), True, skills)
        return parts["index_pointer"].item()

    assert index_pointer({"call": call, "reverse": reverse}) == index_pointer({"call": call, "reverse": none})
    assert index_pointer({"call": call, "reverse": none}) != index_pointer({"call": reverse, "reverse": none})


def test_the_index_pointer_loss_reads_the_indexer_that_selects_for_the_lookup_layer(tokenizer):
    from dsaserve.demo.train import index_pointer_loss, watched_heads
    from dsaserve.demo.train_model import ForwardOutput, IndexerTrace

    s = 5
    pointers = torch.tensor([[0, 4, 1], [0, 3, 2]])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    flat = torch.zeros(1, s, s).masked_fill(~causal, float("-inf"))  # uniform over each query's visible keys
    sharp = flat.clone()
    sharp[0, 4, 1] = sharp[0, 3, 2] = 100.0  # all weight on the pointed keys
    for layout, serving in ((["full", "shared", "full", "shared"], 0), (["full", "full", "shared", "shared"], 1)):
        cfg = ModelConfig.from_dict(model_config(tokenizer, **{**SMALL, "indexer_types": layout}))
        traces = [IndexerTrace(sharp if i == serving else flat, None) for i in range(2)]
        loss = index_pointer_loss(ForwardOutput(None, None, None, traces, {}), cfg, watched_heads(cfg), pointers)
        assert loss.item() == pytest.approx(0.0, abs=1e-6)
    cfg = ModelConfig.from_dict(model_config(tokenizer, **SMALL))
    traces = [IndexerTrace(flat, None), IndexerTrace(sharp, None)]
    loss = index_pointer_loss(ForwardOutput(None, None, None, traces, {}), cfg, watched_heads(cfg), pointers)
    assert loss.item() == pytest.approx((math.log(5) + math.log(4)) / 2)  # query 4 sees 5 keys, query 3 four


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
        indexer = [p for n, p in model.net.named_parameters() if ".indexer." in n]
        others = [p for n, p in model.net.named_parameters() if ".indexer." not in n and p.requires_grad]
        kl_grads = torch.autograd.grad(parts["kl"], indexer + others, allow_unused=True)
        assert all(g is not None and g.abs().sum() > 0 for g in kl_grads[: len(indexer)])
        assert all(g is None or g.abs().sum() == 0 for g in kl_grads[len(indexer):])
        lm_grads = torch.autograd.grad(parts["lm"] + parts["mtp"], indexer, allow_unused=True)
        assert all(g is None or g.abs().sum() == 0 for g in lm_grads)


def test_a_few_steps_lower_the_losses_and_write_a_checkpoint_both_engines_load(tokenizer, tmp_path):
    from reference import dsaserve_forward, load_reference, reference_forward

    from dsaserve import LLM
    from dsaserve.demo.train import TrainConfig, train

    tc = TrainConfig(steps=12, dense_steps=6, tokens_per_step=1024, max_doc_tokens=192, save_every=0, warmup=2,
                     chain_steps=3, copy_steps=1, skills_steps=2)
    log: list[str] = []
    train(str(tmp_path), tc, log=log.append, config_overrides=SMALL)
    # The same fixed batch scores better under the written weights than under the initial ones.
    from dsaserve.demo.mtp_chain import load_trainable

    raw = model_config(tokenizer, **SMALL)
    initial = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=tc.seed, shared_embedding=True)
    trained, _ = load_trainable(str(tmp_path), tc.seed)
    encoder = ChatEncoder(tokenizer)
    rng = random.Random(99)
    examples = [encoder.encode(retrieval_chat(rng, 4, 3, 2)) for _ in range(4)]
    ids, target = collate(examples, raw["pad_token_id"])
    with torch.no_grad():
        before, after = (losses(m, ids, target, True, raw["pad_token_id"])[0] for m in (initial, trained))
        heads_before, heads_after = (losses(m, ids, target, False, raw["pad_token_id"], pointer_index(examples))[0]
                                     for m in (initial, trained))  # dense: every key visible to both heads
    assert after["lm"] < before["lm"] - 1 and after["mtp"] < before["mtp"] - 0.5 and after["kl"] < before["kl"]
    assert heads_after["previous"] < heads_before["previous"] - 0.3
    # the lookup head's loss was trained on (12 steps are too few to lower it)
    assert any(" pointer " in line for line in log)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, speculative_config={"method": "mtp",
                                                                                   "num_speculative_tokens": 1})
    ids = llm.tokenizer.encode("[gMASK]<sop><|user|>\nHello!<|assistant|>", add_special_tokens=False)
    ours, expected = dsaserve_forward(str(tmp_path), ids), reference_forward(load_reference(str(tmp_path)), ids)
    assert (ours.logprobs - expected.logprobs).abs().max() < 1e-4


def test_the_skills_phase_opens_with_reversals_trains_the_trunk_and_leaves_the_mtp_layer_as_it_was(tokenizer, tmp_path):
    from safetensors.torch import load_file

    from dsaserve.demo.checkpoint_builder import save_tokenizer_files
    from dsaserve.demo.train import SkillsConfig, train_skills

    raw, model = small_trainable(tokenizer)
    save_checkpoint(str(tmp_path), raw, model.state_dict_for_checkpoint(), dtype=torch.bfloat16)
    save_tokenizer_files(tokenizer, str(tmp_path), raw["eos_token_id"])
    before = load_file(str(tmp_path / "model.safetensors"))
    lines = []
    train_skills(str(tmp_path), SkillsConfig(steps=2, opening_steps=2), log=lines.append)
    after = load_file(str(tmp_path / "model.safetensors"))
    assert [line.split()[4] for line in lines] == ["reverse", "tools"]  # the opening (skills_batch)
    mtp = f"model.layers.{raw['num_hidden_layers']}."
    # (its router's correction bias keeps following the balancing rule, as every router's does)
    kept = [n for n in before if n.startswith(mtp) and not n.endswith("e_score_correction_bias")]
    assert kept and all(torch.equal(before[n], after[n]) for n in kept)
    trained = [n for n in before if not n.startswith(mtp) and not torch.equal(before[n], after[n])]
    assert "model.embed_tokens.weight" in trained and "model.layers.1.self_attn.q_b_proj.weight" in trained


def test_training_is_deterministic_from_its_seed(tmp_path):
    import hashlib

    from dsaserve.demo.train import TrainConfig, train

    digests = []
    for seed, name in ((5, "a"), (5, "b"), (6, "c")):
        tc = TrainConfig(seed=seed, steps=4, dense_steps=2, tokens_per_step=1024, max_doc_tokens=192, save_every=0,
                         warmup=2, chain_steps=2, copy_steps=1, skills_steps=2)
        train(str(tmp_path / name), tc, log=lambda line: None, config_overrides=SMALL)
        digests.append(hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]


def test_the_whole_run_gives_each_later_phase_the_steps_its_own_config_has():
    """`build-demo --train` must reproduce the weights trained phase by phase (python -m dsaserve.demo.train)."""
    from dsaserve.demo.mtp_chain import ChainConfig
    from dsaserve.demo.train import SkillsConfig, TrainConfig

    assert TrainConfig().chain_steps == ChainConfig().steps
    assert TrainConfig().skills_steps == SkillsConfig().steps


def test_chained_draft_steps_equal_the_layer_run_over_a_rounds_rows(tokenizer):
    """The chain's step k at base j is the MTP layer over the rows a draft round has at that point: step-1
    rows 0…j, then this base's draft rows, each fed the previous step's output (its input written out here)."""
    from dsaserve.demo.mtp_chain import chain_logits
    from dsaserve.demo.train_model import TrainingPass

    raw, model = small_trainable(tokenizer)
    cfg, pad, eps, net = model.cfg, raw["pad_token_id"], model.cfg.rms_norm_eps, model.net
    ids, _ = collate([ChatEncoder(tokenizer).encode(retrieval_chat(random.Random(8), 2, 3, 1))], pad)
    ids = ids[:, :40]

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * model.w(name)

    with torch.no_grad():
        ref = model(ids, sparse=False)
        chain = chain_logits(model, ids, ref.final_hidden, pad, 3)
        assert torch.allclose(chain[0][:, :-1], ref.mtp_logits[:, :-1], atol=1e-4)  # (the last row drafts nothing)
        p = f"model.layers.{cfg.num_hidden_layers}"
        embed, lm_head = model.w("model.embed_tokens.weight"), model.w("lm_head.weight")

        def block_input(token: int, prev: torch.Tensor, zero: bool) -> torch.Tensor:
            e = torch.zeros_like(embed[token]) if zero else embed[token]
            return torch.cat([rms(e, f"{p}.enorm.weight"), rms(prev, f"{p}.hnorm.weight")]) @ model.w(
                f"{p}.eh_proj.weight").T

        def run(rows: list[torch.Tensor]) -> torch.Tensor:  # the block over these rows, causal and dense
            n = len(rows)
            batch = TrainingPass.of(torch.zeros(1, n, dtype=torch.long), sparse=False, index=False)
            cos, sin = net.rotary.cos_sin(batch.positions, torch.float32)
            return net.mtp.block(torch.stack(rows), cos, sin, batch, None, None, None)[0][-1]

        tokens = ids[0].tolist()
        for j in (5, 21, 36):
            rows = [block_input(tokens[i + 1], ref.final_hidden[0, i], i == 0) for i in range(j + 1)]
            prev = run(rows)
            for k in (2, 3):
                rows.append(block_input(tokens[j + k], prev, False))
                prev = run(rows)
                expected = rms(prev, f"{p}.shared_head.norm.weight") @ lm_head.T
                assert torch.allclose(chain[k - 1][0, j], expected, atol=1e-4), (j, k)
