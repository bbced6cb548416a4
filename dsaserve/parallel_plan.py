"""The per-rank plan `dsaserve doctor --tensor-parallel-size N [...]` prints: before a long load, what
each rank reads and holds, and how much context fits.

It adds up the slices distributed/sharding.py assigns (the loader reads exactly these), so the
numbers are the loader's own: bytes as stored in the checkpoint, bytes resident once loaded
(FP8 weights kept as shipped, with a scale per row and 128 columns, as the native CPU kernels and the Triton
kernels hold them; the rest in the model dtype), KV bytes per token per rank, and the tokens of KV that fit in a
given device memory once the largest step's activations are held back (an estimate here; a GPU engine measures
them at start-up, engine/workers/memory_profile.py), with an estimate of the decode graphs' pool.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from dsaserve.attention.scored_selection import SCORE_ELEMENTS
from dsaserve.attention.tile_unions import build_bytes
from dsaserve.byte_sizes import human
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.distributed.sharding import ShardPlan, TensorSlice, tensor_slice
from dsaserve.model.glm_moe_dsa import FP32_PARAM_SUFFIXES
from dsaserve.model.loader import KV_B_NAME
from dsaserve.quantization.formats import scale_columns
from dsaserve.quantization.fp8_blocks import is_fp8_quantizable
from dsaserve.triton_ops.row_topk import BINS

FP8_BLOCK = 128 * 128  # elements per weight_scale_inv entry
SCORE_BYTES = SCORE_ELEMENTS * 4  # the indexer's score tile on the CUDA path (fp32)
KIND_WORDS = {"replicated": "whole", "heads": "by attention head", "intermediate": "by intermediate dimension",
              "experts": "whole experts of its own", "vocab": "by vocabulary rows"}


@dataclass
class RankShare:
    stored: int = 0  # bytes read from the checkpoint
    resident: int = 0  # bytes held once loaded
    kinds: Counter = field(default_factory=Counter)  # tensors read, by how they are split
    ranges: dict = field(default_factory=dict)  # heads / experts / vocab rows this rank holds


def rank_shares(cfg: ModelConfig, parallel: ParallelConfig, tensors: dict[str, tuple[tuple[int, ...], int]],
                resident_item: int, fp8_kept: bool = True) -> list[RankShare]:
    """tensors: name → (shape, bytes per element as stored; 1 for FP8 weights, which add their scales). fp8_kept:
    FP8 weights stay FP8 once loaded (else they are dequantized to resident_item bytes)."""
    shares = []
    for rank in range(parallel.world_size):
        plan = ShardPlan(rank, parallel.world_size, parallel.enable_expert_parallel)
        share = RankShare()
        for name, (shape, item) in tensors.items():
            part = tensor_slice(cfg, plan, name, shape)
            if part is None:
                continue
            numel = math.prod(part.shape_of(shape))
            share.kinds[part.kind] += 1
            share.stored += numel * item + (math.ceil(numel / FP8_BLOCK) * 4 if item == 1 else 0)
            if part.kind == "vocab":  # every rank holds as many rows, the last one's past V being padding
                first, last = plan.vocab_rows(cfg.vocab_size)
                numel = (last - first) * math.prod(shape[1:])
            share.resident += _resident(name, part, shape, numel, item if fp8_kept else resident_item, resident_item)
        heads = plan.split(cfg.num_attention_heads)
        vocab = plan.vocab_rows(cfg.vocab_size)
        share.ranges = {"heads": f"{heads[0]}-{heads[1] - 1}",
                        "vocab rows": f"{vocab[0]}-{min(vocab[1], cfg.vocab_size) - 1}"}
        if parallel.enable_expert_parallel:
            experts = plan.local_experts(cfg.n_routed_experts)
            share.ranges["experts"] = f"{experts[0]}-{experts[1] - 1}"
        shares.append(share)
    return shares


def plan_lines(cfg: ModelConfig, parallel: ParallelConfig, tensors, resident_item: int, resident_dtype: str,
               kv_bytes_per_token: int, device_memory: int | None, utilization: float,
               state_bytes_per_request: int = 0, indexer_bytes_per_token: int = 0,
               step: tuple[int, int] = (8192, 256), graph_tokens: int = 256) -> list[str]:
    """The plan as doctor prints it; kv_bytes_per_token is one rank's for a token it stores (indexer keys
    included: indexer_bytes_per_token of it), state_bytes_per_request one rank's share of a hybrid model's KDA
    state, step the largest step's (tokens, rows of logits): max_num_batched_tokens and max_num_seqs, and
    graph_tokens the rows of the largest captured decode step (0: none are captured)."""
    dcp = parallel.decode_context_parallel_size
    shares = rank_shares(cfg, parallel, tensors, resident_item)
    lines = [f"parallel plan: tensor parallel {parallel.tensor_parallel_size}"
             + (", expert parallel" if parallel.enable_expert_parallel else "")
             + (f", decode context parallel {dcp}" if dcp > 1 else "") + f" ({parallel.world_size} ranks)"
             if parallel.world_size > 1 else "device plan: one device (--tensor-parallel-size 1)"]
    first = shares[0]
    kinds = ", ".join(f"{first.kinds[kind]:,} {how}" for kind, how in KIND_WORDS.items() if first.kinds[kind])
    lines.append(f"  rank 0 reads {sum(first.kinds.values()):,} tensors: {kinds}")
    lines.append(f"  {'rank':>6} {'stored':>12} {'resident':>12}  holds")
    for rank, share in enumerate(shares):
        ranges = ", ".join(f"{k} {v}" for k, v in share.ranges.items())
        lines.append(f"  {rank:>6} {human(share.stored):>12} {human(share.resident):>12}  {ranges}")
    fp8 = any(item == 1 for _, item in tensors.values())
    lines.append("  (stored: read from the checkpoint; resident: held once loaded, "
                 + ("FP8 weights as shipped where the native CPU or the Triton kernels run\n   with a scale per row "
                    "and 128 columns, the rest " if fp8 else "") + f"in {resident_dtype})")
    per_rank = kv_bytes_per_token / dcp
    split = (f" (latent {human((kv_bytes_per_token - indexer_bytes_per_token) / dcp)}, indexer keys "
             f"{human(indexer_bytes_per_token / dcp)})" if indexer_bytes_per_token else "")
    lines.append(f"  KV cache per token per rank: {human(per_rank)}{split}"
                 + (f" (each rank stores 1/{dcp} of a request's tokens)" if dcp > 1 else
                    " (MLA's one latent head: every rank holds the whole latent)"))
    if state_bytes_per_request:
        lines.append(f"  KDA state per request per rank: {human(state_bytes_per_request)} (its heads are split: "
                     f"1/{parallel.tensor_parallel_size} of the state)")
    if device_memory:
        activations = step_activation_bytes(cfg, parallel, step[0], step[1], resident_item)
        lines.append(f"  the largest step ({step[0]:,} tokens, {step[1]} rows of logits: max_num_batched_tokens and "
                     f"max_num_seqs): about {human(activations)} of activations per rank (an estimate; on a GPU the "
                     f"engine measures it at start-up and takes it out of the {utilization:g} share); "
                     + _graphs_words(cfg, parallel, graph_tokens, resident_item, device_memory * (1 - utilization),
                                     state_bytes_per_request))
        lines.append(_fit_line(max(s.resident for s in shares), activations, device_memory, utilization, per_rank))
        if fp8:
            dequantized = max(s.resident for s in rank_shares(cfg, parallel, tensors, resident_item, fp8_kept=False))
            lines.append(f"  FP8 weights dequantized to {resident_dtype} (--triton-kernels off, or a CPU without the "
                         f"native kernels):\n"
                         f"  {_fit_line(dequantized, activations, device_memory, utilization, per_rank)}")
    return lines


def step_activation_bytes(cfg: ModelConfig, parallel: ParallelConfig, tokens: int, logits_rows: int,
                          item: int) -> int:
    """An estimate of one rank's transient bytes in the largest step (`tokens` rows, `logits_rows` rows of logits;
    activations of `item` bytes): the residual stream and its normed copy with the widest sublayer's
    intermediates, or with the logits (fp32, gathered over the vocabulary, and their log-softmax). The engine
    measures the real figure on a GPU at start-up (engine/workers/memory_profile.py) and logs both."""
    tp = parallel.tensor_parallel_size
    heads = cfg.num_attention_heads // tp
    rope = cfg.qk_rope_head_dim
    # q_a, the per-head queries, the absorbed queries and the attention's output (both latent-wide), v heads
    attention = cfg.q_lora_rank + heads * (cfg.qk_nope_head_dim + rope + 2 * (cfg.kv_lora_rank + rope)
                                           + cfg.v_head_dim)
    # q, its weights, the top-k's first histogram, the top-k and per top-k entry a slot and its member bits (tile
    # unions; or one int64 slot), then the score tile or the unions' build, whichever is larger (they do not overlap)
    indexer = (tokens * (cfg.index_n_heads * (cfg.index_head_dim * item + 4) + BINS * 4 + 3 * cfg.index_topk * 4)
               + max(SCORE_BYTES, build_bytes(tokens * cfg.index_topk)))
    # routed rows: every (token, expert) pair may land on this rank; gate and up, their product, and the output
    width = cfg.moe_intermediate_size // (1 if parallel.enable_expert_parallel else tp)
    experts = tokens * (cfg.num_experts_per_tok + cfg.n_shared_experts) * (3 * width + cfg.hidden_size)
    dense = tokens * 3 * (cfg.intermediate_size // tp)
    widest = max(tokens * attention * item + indexer, max(experts, dense) * item)
    logits = logits_rows * cfg.vocab_size * 4 * 2
    return 2 * tokens * cfg.hidden_size * item + max(widest, logits)


def graph_pool_bytes(cfg: ModelConfig, parallel: ParallelConfig, tokens: int, item: int,
                     state_bytes_per_request: int = 0) -> int:
    """An estimate of what the decode graphs take (engine/workers/decode_graphs.py): their shared pool holds one
    step's intermediates, the largest captured step's (`tokens` rows, each with its logits), and every graph writes
    into one set of outputs (logits in fp32 and hidden states, as many rows); a hybrid model's padding requests hold
    one more KDA state."""
    outputs = tokens * (cfg.vocab_size * 4 + cfg.hidden_size * item)
    return step_activation_bytes(cfg, parallel, tokens, tokens, item) + outputs + state_bytes_per_request


def _graphs_words(cfg: ModelConfig, parallel: ParallelConfig, tokens: int, item: int, rest: float,
                  state_bytes_per_request: int = 0) -> str:
    if not tokens:
        return "no CUDA graphs"
    graphs = graph_pool_bytes(cfg, parallel, tokens, item, state_bytes_per_request)
    padding = " and the padding requests' KDA state" if state_bytes_per_request else ""
    return (f"CUDA graphs about {human(graphs)} (decode steps of up to {tokens} rows; more with speculative decoding's "
            f"verify rows{padding}), out of the other {human(rest)}"
            + ("" if graphs <= rest else ": too little; lower gpu_memory_utilization or --cuda-graph-sizes"))


def _fit_line(weights: int, activations: int, device_memory: int, utilization: float, kv_per_token: float) -> str:
    share = device_memory * utilization
    room = share - weights - activations
    if share <= weights:
        return (f"  with {human(device_memory)} per rank (× {utilization:g}): does not fit, the weights alone need "
                f"{human(weights)} per rank; use more ranks")
    if room <= 0:
        return (f"  with {human(device_memory)} per rank (× {utilization:g}): does not fit, the weights "
                f"({human(weights)}) and the largest step ({human(activations)}) leave no room for the KV cache; "
                "lower max_num_batched_tokens or use more ranks")
    return (f"  with {human(device_memory)} per rank (× {utilization:g}): {human(room)} left for the KV cache = "
            f"{int(room // kv_per_token):,} tokens of context in all")


def _resident(name: str, part: TensorSlice, shape: tuple[int, ...], numel: int, item: int, resident_item: int) -> int:
    """Bytes a rank holds of its part (numel elements) of a tensor stored `item` bytes per element. An FP8 weight
    kept as shipped holds its bytes and a scale per row and 128 columns; kv_b_proj is split per head into W_UK and
    W_UV at load, in floats."""
    part_shape = part.shape_of(shape)
    if item == 1 and KV_B_NAME not in name:
        col_offset = part.start % 128 if part.dim == 1 else 0
        return numel + numel // part_shape[-1] * scale_columns("fp8", part_shape[-1], col_offset) * 4
    return numel * (4 if name.endswith(FP32_PARAM_SUFFIXES) else resident_item)



def stored_items(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                 item: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Bytes per element of each tensor of a config-only checkpoint: FP8 weights where the config says
    the checkpoint is FP8 (scales added per 128×128 block), the checkpoint dtype elsewhere."""

    skip = tuple((cfg.quantization_config or {}).get("modules_to_not_convert") or ())

    def stored(name: str) -> int:
        return 1 if cfg.fp8_checkpoint and is_fp8_quantizable(name) and not any(m in name for m in skip) else item

    return {name: (shape, stored(name)) for name, shape in shapes.items()}
