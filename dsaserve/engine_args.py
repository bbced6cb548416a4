"""EngineArgs: every engine option, defined once, for `LLM(...)`, `serve`, `generate` and every `bench`.

Each field is both a keyword of `LLM(model, **kwargs)` and a CLI flag of the same name with dashes
(`max_num_seqs` ↔ `--max-num-seqs`), as in vLLM. Boolean options that default to on get vLLM's
`--no-…` spelling to turn them off.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field

from dsaserve.attention import ATTENTION_BACKENDS
from dsaserve.attention.indexer_cache import INDEXER_CACHE_DTYPES, indexer_key_kind
from dsaserve.cuda_graph_sizes import capture_sizes, parse_sizes
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.native.torch_ops import CPU_ISAS, NATIVE_KERNELS, check_cpu_isa
from dsaserve.quantization.formats import QUANTIZATION_MODES
from dsaserve.speculative_config import SpeculativeConfig
from dsaserve.triton_ops import TRITON_KERNELS


def parse_bytes(value: int | str | None, field: str = "kv_cache_memory") -> int | None:
    """A size as bytes: an int, or a string such as '512MiB', '4GiB', '1.5GB'; `field` names it in the error."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"{field}={value!r} is not a size; use bytes or e.g. '512MiB', '4GiB'")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


# Not flags: commands use --seed for their own seeds (of a request, of random prompts), and the CLI
# always shows load progress.
NOT_ON_CLI = ("seed", "progress")


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata=_help("checkpoint directory (default: the built-in demo model)"))
    dtype: str = field(default="auto", metadata=_help("auto | float32 | bfloat16 | float16"))
    device: str | None = field(default=None, metadata=_help("cpu | cuda (default: cuda when available)"))
    attention_backend: str = field(default="sparse", metadata=_help(
        "sparse (the model's token top-k), page (whole pages, approximate) or dense (indexer skipped)",
        choices=ATTENTION_BACKENDS))
    page_budget: int | None = field(default=None, metadata=_help(
        "pages per query for --attention-backend page (default: index_topk / block size)"))
    indexer_cache_dtype: str = field(default="auto", metadata=_help(
        "indexer key cache: auto (int8 where the weights are FP8, as FP8 releases are served; the model dtype "
        "otherwise), model (the model dtype), int8 (+fp16 scale per token) or fp8 (+fp32 scale)",
        choices=INDEXER_CACHE_DTYPES))
    max_model_len: int | None = field(default=None, metadata=_help("longest prompt + output, in tokens"))
    block_size: int = field(default=64, metadata=_help("tokens per KV cache block"))
    kv_cache_memory: int | str | None = field(default=None, metadata=_help(
        "KV cache size per rank, e.g. 2GiB (default on CUDA: what gpu-memory-utilization leaves; on CPU: "
        "max-num-seqs × max-model-len tokens, up to 1 GiB; max-model-len is lowered to what the cache holds unless "
        "given)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "on CUDA, the share of each GPU's memory for the weights, the largest step's activations (measured at "
        "start-up) and the KV cache, which takes the rest of that share; CUDA graphs come out of the remainder"))
    max_num_seqs: int = field(default=256, metadata=_help("most sequences in one batch"))
    max_num_batched_tokens: int = field(default=8192, metadata=_help("token budget of one step"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("turn prefix caching off (on by default)"))
    enable_chunked_prefill: bool = field(default=True, metadata=_help("turn chunked prefill off (on by default)"))
    state_snapshots: int | None = field(default=None, metadata=_help(
        "hybrid models (glm5_next) with prefix caching: KDA state snapshots kept at prefix positions, where a later "
        "request sharing the prefix resumes; each holds one request's KDA state, counted in kv-cache-memory "
        "(default: max-num-seqs; 0: prefix caching off for such models; without kv-cache-memory both are lowered "
        "until the states fit a quarter of the memory available)"))
    state_snapshot_interval: int = field(default=512, metadata=_help(
        "hybrid models: tokens between a request's KDA state snapshots (a multiple of block-size); a prefix-cache "
        "hit resumes at the last snapshot inside the shared prefix"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "ranks (devices or processes) to split the model over: attention heads, MLPs, experts and vocabulary"))
    enable_expert_parallel: bool = field(default=False, metadata=_help(
        "place whole routed experts on the tensor-parallel ranks instead of splitting every expert"))
    decode_context_parallel_size: int = field(default=1, metadata=_help(
        "split the KV cache along the sequence over this many of the tensor-parallel ranks (N× KV capacity per rank)"))
    nnodes: int = field(default=1, metadata=_help("nodes the ranks run on (tensor_parallel_size / nnodes each)"))
    node_rank: int = field(default=0, metadata=_help("this node's index; node 0 runs the server and rank 0"))
    master_addr: str = field(default="127.0.0.1", metadata=_help("node 0's address, where the ranks meet"))
    master_port: int | None = field(default=None, metadata=_help(
        "port on node 0 where the ranks meet (default on one node: a free one)"))
    dist_timeout: float = field(default=600.0, metadata=_help(
        "seconds a collective may wait for the other ranks before the step fails naming them"))
    check_ranks: bool = field(default=False, metadata=_help(
        "ranks compare every full layer's top-k each step and fail naming the layer where they differ (debugging)"))
    quantization: str | None = field(default=None, metadata=_help(
        "keep the projections' weights in 8 or 4 bits: fp8 (128x128 blocks), int8 (per row) or int4 (groups of 128); "
        "an FP8 checkpoint stays in FP8 without it (where the CPU kernels run)", choices=QUANTIZATION_MODES))
    hf_overrides: dict | str | None = field(default=None, metadata=_help(
        "JSON object patched into config.json, e.g. '{\"index_topk_pattern\": \"FFSS\"}'"))
    speculative_config: dict | str | None = field(default=None, metadata=_help(
        "speculative decoding with the checkpoint's MTP layer, as JSON: "
        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'"))
    native_kernels: str = field(default="auto", metadata=_help(
        "CPU kernels this process uses: auto (the best bodies this CPU has: AMX tiles where they pass their check at "
        "load, int8-rounded activations for int8 and int4 weights (VNNI; int4 on the AVX2 families too), VBMI fp8 "
        "lookups), avx512 (the same without the AMX tiles, the int8-rounded activations and the VBMI lookups: the "
        "exact bodies, for comparing) or off (torch's operators only)", choices=NATIVE_KERNELS))
    cpu_isa: str = field(default="auto", metadata=_help(
        "which body family the CPU kernels run, chosen once at load: auto (the best this CPU has), amx, avx512_bf16, "
        "avx512 (AVX-512 without BF16: the AVX2 family with its weight products 512 bits wide), avx2 (also on "
        "AVX-512 CPUs: what an AVX2-only server gets; under avx512 and avx2 dtype auto computes in fp32), none (no "
        "native body: what a CPU without AVX2 gets); a family the CPU lacks is an error", choices=CPU_ISAS))
    triton_kernels: str = field(default="auto", metadata=_help(
        "Triton kernels for the sparse attention and the indexer's scores: auto (where the device is CUDA and Triton "
        "imports), off (torch's operators there) or on (also on CPU tensors, under Triton's interpreter: "
        "TRITON_INTERPRET=1, slow; for checking the CUDA path without a GPU, with the native CPU kernels off)",
        choices=TRITON_KERNELS))
    load_scratch_memory: int | str | None = field(default=None, metadata=_help(
        "memory the weight-loading threads may use to convert tensors, e.g. 256MiB: 64 MiB per thread, so it also "
        "caps their number (default: a sixteenth of the memory available, between 64 and 512 MiB)"))
    huge_pages: bool = field(default=True, metadata=_help(
        "keep the weights out of 2 MiB transparent huge pages (on by default where Linux allows them)"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "run every step through the model's modules: no decode plan (a decode step's layers as one chain of native "
        "pieces, on CPUs with the kernels) and no CUDA graphs (decode steps replayed from captures, on CUDA); for "
        "comparing and debugging"))
    cuda_graph_sizes: str | None = field(default=None, metadata=_help(
        "decode batch sizes captured as CUDA graphs at start-up, e.g. '1,2,4,8' (default: powers of two up to "
        "max-num-seqs, at most 256, and that bound); a decode step of n requests replays the smallest size ≥ n, "
        "larger or mixed steps run eagerly"))
    seed: int = field(default=0, metadata=_help("seed of the sampler for requests without their own seed"))
    progress: bool = field(default=True, metadata=_help("show a progress bar while loading weights"))

    def __post_init__(self) -> None:
        self.parallel  # a bad parallel layout fails here, before anything loads
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.state_snapshot_interval < 1 or self.state_snapshot_interval % self.block_size:
            raise ValueError(f"state_snapshot_interval={self.state_snapshot_interval} must be a positive multiple of "
                             f"block_size={self.block_size}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots={self.state_snapshots} must be 0 or more")
        if self.page_budget is not None and self.page_budget < 1:
            raise ValueError(f"page_budget={self.page_budget} must be at least 1 page")
        if self.native_kernels not in NATIVE_KERNELS:
            raise ValueError(f"native_kernels={self.native_kernels!r} is not supported; use one of "
                             f"{', '.join(NATIVE_KERNELS)}")
        check_cpu_isa(self.cpu_isa)
        if self.triton_kernels not in TRITON_KERNELS:
            raise ValueError(f"triton_kernels={self.triton_kernels!r} is not supported; use one of "
                             f"{', '.join(TRITON_KERNELS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={self.quantization!r} is not supported; use one of "
                             f"{', '.join(QUANTIZATION_MODES)} (or leave it unset)")
        indexer_key_kind(self.indexer_cache_dtype, fp8_weights=False)  # a bad kind fails here, before anything loads
        parse_bytes(self.kv_cache_memory)  # a bad size fails here, before anything loads
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be above 0 and at most 1 "
                             "(the share of each GPU's memory the engine may use)")
        parse_bytes(self.load_scratch_memory, "load_scratch_memory")
        SpeculativeConfig.parse(self.speculative_config)  # and so does a bad speculative config
        parse_sizes(self.cuda_graph_sizes)

    @property
    def num_state_snapshots(self) -> int:
        """KDA state snapshots a hybrid model keeps for prefix caching (none with prefix caching off)."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.state_snapshots is None else self.state_snapshots

    @property
    def num_draft_states(self) -> int:
        """KDA states a hybrid model keeps per running request while speculating: the state after each draft's
        row, to roll back to after verification."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel, self.decode_context_parallel_size,
                              self.nnodes, self.node_rank, self.master_addr, self.master_port, self.dist_timeout,
                              self.check_ranks)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return capture_sizes(parse_sizes(self.cuda_graph_sizes), self.max_num_seqs)

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_bytes(self.kv_cache_memory)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per field (the model as a positional argument), except `skip` and NOT_ON_CLI."""
        for f in dataclasses.fields(cls):
            if f.name in skip or f.name in NOT_ON_CLI:
                continue
            meta = dict(f.metadata)
            if f.name == "model":
                parser.add_argument("model", nargs="?", default=None, **meta)
            elif f.type == "bool" and f.default is True:
                parser.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", **meta)
            elif f.type == "bool":
                parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action="store_true", **meta)
            else:
                kind = {"int": int, "int | None": int, "float": float}.get(f.type, str)
                parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=f.default, **meta)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides) -> "EngineArgs":
        values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)
                  if f.name not in NOT_ON_CLI and hasattr(namespace, f.name)}
        return cls(**{**values, **overrides})
