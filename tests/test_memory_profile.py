"""The KV cache's share of a GPU (gpu_memory_utilization), from the largest step measured at start-up
(engine/workers/memory_profile.py). CI has no GPU: the engine is told its CPU is measured like one, with the
device's totals and the step's peak given, while the profiling step itself runs the real model."""

import pytest
import torch

from dsaserve import LLM, SamplingParams
from dsaserve.engine.workers import memory_profile
from dsaserve.engine.workers.memory_profile import DeviceMemory, kv_cache_memory
from dsaserve.engine_args import EngineArgs

GIB, MIB = 1 << 30, 1 << 20


def test_the_kv_cache_takes_what_the_tightest_rank_has_left_of_its_share():
    profiles = [DeviceMemory(80 * GIB, 30 * GIB, 2 * GIB, 8192), DeviceMemory(80 * GIB, 31 * GIB, 3 * GIB, 8192)]
    assert kv_cache_memory(profiles, 0.9) == int(80 * GIB * 0.9) - 34 * GIB


def test_no_room_left_names_the_option_the_rank_and_the_step():
    profiles = [DeviceMemory(80 * GIB, 10 * GIB, GIB, 8192), DeviceMemory(80 * GIB, 39 * GIB, 2 * GIB, 8192)]
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 leaves no room .* rank 1: .* a step of 8192 "
                                         r"tokens; raise gpu_memory_utilization, lower max_num_batched_tokens"):
        kv_cache_memory(profiles, 0.5)


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_gpu_memory_utilization_outside_0_to_1_is_refused(value):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization={value} must be above 0 and at most 1"):
        EngineArgs(model="unused", gpu_memory_utilization=value)


CHECKPOINTS = {"glm_moe_dsa": ("tiny-mtp", dict(seed=3, include_mtp=True)),
               "glm5_next": ("glm5_next_mtp", dict(seed=5, model_type="glm5_next", include_mtp=True))}


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_the_engine_sizes_its_kv_cache_from_the_measured_device(make_checkpoint, family, monkeypatch):
    """Measured like a GPU: one profiling step of min(max_num_batched_tokens, max_model_len) tokens with a full
    batch's logits rows (drafts included) on a cache of its own; the KV cache then holds
    utilization × total − in use − peak, and requests run as with that size given."""
    name, kwargs = CHECKPOINTS[family]
    checkpoint = make_checkpoint(name, **kwargs)
    total, in_use, peak = 64 * MIB, 20 * MIB, 4 * MIB
    steps = []
    run_step = memory_profile.run_largest_step

    def recorded(model, cache, tokens, logits_rows, block_size):
        logits = run_step(model, cache, tokens, logits_rows, block_size)
        steps.append((tokens, tuple(logits.shape), cache.num_blocks * cache.block_size))
        return logits

    def given_peak(device, step):
        step()
        return peak

    monkeypatch.setattr(memory_profile, "measured", lambda device: True)
    monkeypatch.setattr(memory_profile, "device_totals", lambda device: (total, total - in_use))
    monkeypatch.setattr(memory_profile, "step_peak", given_peak)
    monkeypatch.setattr(memory_profile, "run_largest_step", recorded)
    args = dict(dtype="float32", block_size=16, progress=False, max_model_len=160, max_num_seqs=3,
                speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["the first prompt", "a second one, longer than the first"]
    measured = LLM(checkpoint, max_num_batched_tokens=96, gpu_memory_utilization=0.5, **args)
    room = int(total * 0.5) - in_use - peak
    per_block = measured.engine.kv_layout.bytes_per_token * 16
    assert steps == [(96, (9, measured.engine.config.vocab_size), 96)]  # 3 requests × (1 + 2 drafts) rows
    ours = [o.outputs[0].token_ids for o in measured.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(memory_profile, "measured", lambda device: False)
    given = LLM(checkpoint, max_num_batched_tokens=96, kv_cache_memory=room, **args)
    assert measured.engine.scheduler.kv.num_blocks == given.engine.scheduler.kv.num_blocks
    if measured.engine.config.hybrid is None:  # (a hybrid model's KDA states come out of the room first)
        assert measured.engine.scheduler.kv.num_blocks == room // per_block
    assert ours == [o.outputs[0].token_ids for o in given.generate(prompts, params, use_tqdm=False)]


def test_a_short_max_model_len_bounds_the_profiled_step(tiny_checkpoint, monkeypatch):
    steps = []
    monkeypatch.setattr(memory_profile, "measured", lambda device: True)
    monkeypatch.setattr(memory_profile, "device_totals", lambda device: (64 * MIB, 60 * MIB))
    monkeypatch.setattr(memory_profile, "step_peak", lambda device, step: step() or MIB)
    monkeypatch.setattr(memory_profile, "run_largest_step",
                        lambda model, cache, tokens, rows, block_size: steps.append((tokens, rows)))
    LLM(tiny_checkpoint, dtype="float32", block_size=16, progress=False, max_model_len=48, max_num_seqs=256)
    assert steps == [(48, 48)]


def test_bench_longctx_shares_the_gpu_between_its_engines(tiny_checkpoint, monkeypatch):
    """Its engines stay loaded together: measured like a GPU, the i-th of n asks for (i + 1) / n of the utilization
    in all, so the first does not take the whole share and leave the others none."""
    from dsaserve.bench import longctx

    asked = []
    real = memory_profile.kv_cache_memory
    monkeypatch.setattr(memory_profile, "measured", lambda device: True)
    monkeypatch.setattr(memory_profile, "device_totals", lambda device: (256 * MIB, 200 * MIB))
    monkeypatch.setattr(memory_profile, "step_peak", lambda device, step: (step(), MIB)[1])
    monkeypatch.setattr(memory_profile, "kv_cache_memory",
                        lambda profiles, utilization, estimate=None: asked.append(utilization)
                        or real(profiles, utilization, estimate))
    args = EngineArgs(model=tiny_checkpoint, dtype="float32", block_size=16, max_model_len=128, max_num_seqs=2,
                      gpu_memory_utilization=0.9)
    longctx.run(args, ["dense", "sparse"], [64], [], 1)
    assert asked == [0.45, 0.9]


def test_a_largest_step_that_runs_out_of_memory_names_the_option(tiny_checkpoint, monkeypatch):
    def out_of_memory(device, step):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(memory_profile, "measured", lambda device: True)
    monkeypatch.setattr(memory_profile, "step_peak", out_of_memory)
    with pytest.raises(ValueError, match=r"largest step the scheduler can give \(96 tokens: max_num_batched_tokens.*"
                                         r"lower max_num_batched_tokens or use more ranks \(CUDA out of memory"):
        LLM(tiny_checkpoint, dtype="float32", block_size=16, progress=False, max_model_len=128,
            max_num_batched_tokens=96)
