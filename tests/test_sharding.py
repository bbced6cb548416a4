"""Which part of each checkpoint tensor a rank reads and holds, checked without starting any process: the
loader reads only a rank's slices, FP8 slices dequantize exactly as the whole tensor does, doctor's per-rank
plan is what the model holds, and layouts the model cannot take are refused naming the field."""

import subprocess
import sys

import pytest
import torch
from conftest import REFERENCE_CONFIG
from safetensors.torch import load_file

import dsaserve.model.loader as loader
from dsaserve.config import ModelConfig
from dsaserve.demo.checkpoint_builder import quantize_fp8
from dsaserve.distributed.communicator import Communicator
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.distributed.sharding import ShardPlan
from dsaserve.doctor import report
from dsaserve.model import load_model
from dsaserve.model.glm_moe_dsa import GlmMoeDsaForCausalLM
from dsaserve.parallel_plan import rank_shares


def rank_of(rank: int, size: int, expert_parallel: bool = False) -> ParallelContext:
    """Rank `rank` of `size` as the model sees it; building and loading need no process group."""
    return ParallelContext(Communicator(None, tuple(range(size)), rank), expert_parallel=expert_parallel)


class ReadLog:
    """safe_open and the mapped file's row views that record what is read: whole tensors, or the index of a slice
    (a tensor's row chunks read as views of its mapped file count as one slice of their rows)."""

    def __init__(self, monkeypatch):
        self.whole, self.sliced = set(), {}
        real = loader.safe_open
        log = self

        class Handle:
            def __init__(self, path, framework):
                self.f = real(path, framework)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                log.whole.add(name)
                return self.f.get_tensor(name)

            def get_slice(self, name):
                piece = self.f.get_slice(name)

                class Slice:
                    def __getitem__(self, index):
                        log.sliced[name] = index
                        return piece[index]

                    def __getattr__(self, attr):
                        return getattr(piece, attr)

                return Slice()

        monkeypatch.setattr(loader, "safe_open", Handle)
        real_rows, names = loader.mapped_rows, {}

        def mapped_rows(mapped, info, r0, r1):
            if (info.file, info.offset) not in names:  # the tensors' names by their place in the file
                names.update({(i.file, i.offset): n for n, i in loader.read_tensor_infos([info.file]).items()})
            name = names[(info.file, info.offset)]
            seen = log.sliced.get(name, (slice(r0, r1), slice(None)))[0]
            log.sliced[name] = (slice(min(seen.start, r0), max(seen.stop, r1)), slice(None))
            return real_rows(mapped, info, r0, r1)

        monkeypatch.setattr(loader, "mapped_rows", mapped_rows)


def test_each_rank_reads_only_its_slices(tiny_checkpoint, monkeypatch):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    full = load_file(f"{tiny_checkpoint}/model.safetensors")
    log = ReadLog(monkeypatch)
    model = load_model(cfg, tiny_checkpoint, torch.float32, torch.device("cpu"), progress=False,
                       parallel=rank_of(1, 2, expert_parallel=True))
    params = dict(model.named_parameters())
    attn = "model.layers.2.self_attn"
    assert log.sliced[f"{attn}.q_b_proj.weight"] == (slice(48, 96), slice(None))  # heads 2-3 of 4, 24 rows each
    assert log.sliced[f"{attn}.o_proj.weight"] == (slice(0, cfg.hidden_size), slice(32, 64))  # rows: one chunk
    assert log.sliced["lm_head.weight"] == (slice(cfg.vocab_size // 2, cfg.vocab_size), slice(None))
    assert torch.equal(params[f"{attn}.q_b_proj.weight"], full[f"{attn}.q_b_proj.weight"][48:96])
    assert torch.equal(params[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, 32:64])
    # Whole experts 4-7 of 8, and none of the others.
    experts = {int(n.split(".")[5]) for n in log.whole | set(log.sliced) if ".experts." in n}
    assert experts == {4, 5, 6, 7}
    assert torch.equal(params["model.layers.1.mlp.experts_down"][0],
                       full["model.layers.1.mlp.experts.4.down_proj.weight"])
    split = [n for n in full if n.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight", "lm_head.weight",
                                            "embed_tokens.weight", "shared_experts.down_proj.weight"))]
    assert split and not log.whole & set(split)  # never read whole and then cut


def test_fp8_slices_dequantize_exactly_as_the_whole_tensor():
    weight = torch.randn(300, 200)  # partial 128-blocks in both directions
    q, scale = quantize_fp8(weight)
    whole = loader.dequantize_fp8(q, scale, (128, 128), "w")
    rows = loader.dequantize_fp8(q[100:250], scale, (128, 128), "w", (300, 200), (100, 0))
    cols = loader.dequantize_fp8(q[:, 70:190], scale, (128, 128), "w", (300, 200), (0, 70))
    assert torch.equal(rows, whole[100:250]) and torch.equal(cols, whole[:, 70:190])
    shifted = loader.dequantize_fp8(q[100:250], scale, (128, 128), "w", (300, 200), (0, 0))  # a wrong block index
    assert not torch.equal(shifted, whole[100:250])


@pytest.mark.parametrize("ranks, expert_parallel", [(2, False), (2, True), (3, False)])
def test_doctor_plan_is_what_each_rank_holds(tiny_checkpoint, ranks, expert_parallel):
    """Three ranks split the 640-row vocabulary into 214-row shards, the last one padded."""
    overrides = {"num_attention_heads": 6, "intermediate_size": 384, "moe_intermediate_size": 96} if ranks == 3 else {}
    cfg = ModelConfig.from_pretrained(tiny_checkpoint, hf_overrides=overrides)
    from dsaserve.model.checkpoint_layout import checkpoint_shapes

    tensors = {n: (s, 4) for n, s in checkpoint_shapes(cfg).items()}
    shares = rank_shares(cfg, ParallelConfig(ranks, expert_parallel), tensors, resident_item=4)
    for rank in range(ranks):
        with torch.device("meta"):
            model = GlmMoeDsaForCausalLM(cfg, parallel=rank_of(rank, ranks, expert_parallel))
        held = sum(p.numel() * 4 for p in model.parameters())
        assert shares[rank].resident == held


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "dsaserve", "doctor", *args], capture_output=True, text=True,
                          timeout=120)


def test_doctor_prints_the_glm52_fp8_plan_with_and_without_dcp(tmp_path):
    (tmp_path / "config.json").write_text(open(REFERENCE_CONFIG).read())
    fp8 = '{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}'
    common = [str(tmp_path), "--hf-overrides", fp8, "--tensor-parallel-size", "8", "--device-memory", "141GB"]
    tp = doctor(*common)
    dcp = doctor(*common, "--decode-context-parallel-size", "8")
    assert tp.returncode == dcp.returncode == 0, tp.stderr + dcp.stderr
    assert "parallel plan: tensor parallel 8 (8 ranks)" in tp.stdout
    assert "parallel plan: tensor parallel 8, decode context parallel 8 (8 ranks)" in dcp.stdout
    # MLA's one latent head is on every rank: 78 × 576 × 2 B of latents + 21 × (128 + 2) B of int8 indexer keys (FP8
    # weights keep 8-bit keys by default) = 90.4 KiB per token each; DCP 8 stores an eighth of the tokens.
    assert "KV cache per token per rank: 90.4 KiB" in tp.stdout
    assert "KV cache per token per rank: 11.3 KiB" in dcp.stdout
    assert "heads 56-63, vocab rows 135520-154879" in tp.stdout
    assert "88.2 GiB     91.2 GiB" in tp.stdout  # FP8 weights as stored, and held with a scale per row and block
    # less the largest step's activations (8,192 tokens, 256 rows of logits: an estimate, measured on a GPU)
    assert "about 1.1 GiB of activations per rank" in tp.stdout
    assert "CUDA graphs about 462.8 MiB (decode steps of up to 256 rows" in tp.stdout  # one step's, shared outputs
    assert "(× 0.9): 25.8 GiB left for the KV cache = 299,191 tokens" in tp.stdout
    assert "the weights alone need 175.9 GiB per rank" in tp.stdout  # dequantized to bf16 at load


def test_doctor_prints_one_devices_plan_when_its_memory_is_given(tmp_path, tiny_checkpoint):
    """--device-memory without --tensor-parallel-size: the plan of one device (a GPU's memory, say), what fits."""
    (tmp_path / "config.json").write_text(open(REFERENCE_CONFIG).read())
    fp8 = '{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}'
    big = doctor(str(tmp_path), "--hf-overrides", fp8, "--device-memory", "141GB")
    small = doctor(tiny_checkpoint, "--device-memory", "1GB")
    assert big.returncode == small.returncode == 0, big.stderr + small.stderr
    smaller, _ = report(tiny_checkpoint, parallel=ParallelConfig(1), device_memory=100 * 10**6)  # (in-process: quicker)
    assert "the weights (4.2 MiB) and the largest step (106.8 MiB) leave no room for the KV cache" in smaller
    assert "device plan: one device (--tensor-parallel-size 1)" in big.stdout
    assert "does not fit, the weights alone need 717.0 GiB per rank" in big.stdout
    assert "left for the KV cache =" in small.stdout and "device plan: one device" in small.stdout
    assert "device plan" not in doctor(tiny_checkpoint).stdout  # no memory given, no plan


@pytest.mark.parametrize("layout, overrides, field", [
    (dict(tensor_parallel_size=3), {}, "num_attention_heads=4"),
    (dict(tensor_parallel_size=2), {"moe_intermediate_size": 65}, "moe_intermediate_size=65"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), {"n_routed_experts": 7}, "n_routed_experts=7"),
    (dict(tensor_parallel_size=4, decode_context_parallel_size=3), {}, "decode_context_parallel_size=3"),
    (dict(tensor_parallel_size=1, enable_expert_parallel=True), {}, "enable_expert_parallel"),
    (dict(tensor_parallel_size=2, nnodes=2), {}, "master-port"),
])
def test_layouts_the_model_cannot_take_are_refused(tiny_checkpoint, layout, overrides, field):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint, hf_overrides=overrides)
    with pytest.raises(ValueError, match=field):
        config = ParallelConfig(**{"tensor_parallel_size": 1, **layout})
        config.check_model(cfg, "sparse")


def test_page_backend_refuses_dcp(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match="page"):
        ParallelConfig(2, decode_context_parallel_size=2).check_model(cfg, "page")


def test_vocab_rows_pad_the_last_rank():
    plans = [ShardPlan(r, 3) for r in range(3)]
    assert [p.vocab_rows(1000) for p in plans] == [(0, 334), (334, 668), (668, 1002)]
