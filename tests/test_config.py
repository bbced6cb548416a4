"""Config resolution: the indexer schedule from the checkpoint's own fields, validation, rope, eos."""

import json
import math

import pytest
import torch
from conftest import REFERENCE_CONFIG

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.demo.checkpoint_builder import small_config
from dsaserve.model.glm_moe_dsa import GlmMoeDsaForCausalLM
from dsaserve.model.layers import attention_scale, rope_inv_freq


def glm52() -> dict:
    with open(REFERENCE_CONFIG) as f:
        return json.load(f)


def test_real_glm52_config_resolves_21_full_57_shared_from_indexer_types():
    cfg = ModelConfig.from_dict(glm52())
    sched = cfg.indexer_schedule
    assert sched.source == "indexer_types"
    assert (sched.num_full, sched.num_shared) == (21, 57)
    assert len(sched.pattern) == 78 and sched.pattern.startswith("FFFSSSFSSSF")
    assert any("index_topk_pattern is null" in w for w in sched.warnings)
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert cfg.eos_token_ids == (154820, 154827, 154829)
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 8000000


def test_schedule_logged_as_pattern_string(caplog):
    with caplog.at_level("INFO", logger="dsaserve.config"):
        ModelConfig.from_dict(glm52())
    assert any("FFFSSSFSSSF" in r.getMessage() and "21 full / 57 shared" in r.getMessage() for r in caplog.records)


def test_pattern_string_when_no_explicit_list():
    cfg = ModelConfig.from_dict(small_config(indexer_types=None, index_topk_pattern="FSSF"))
    assert cfg.indexer_schedule.pattern == "FSSF"
    assert cfg.indexer_schedule.source == "index_topk_pattern"


def test_freq_offset_when_no_list_and_no_pattern():
    raw = glm52()
    del raw["indexer_types"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.indexer_schedule.source == "index_topk_freq/index_skip_topk_offset"
    assert cfg.indexer_schedule.pattern == ModelConfig.from_dict(glm52()).indexer_schedule.pattern


def test_all_full_when_no_schedule_fields():
    cfg = ModelConfig.from_dict(small_config(indexer_types=None))
    assert cfg.indexer_schedule.pattern == "FFFF"
    assert cfg.indexer_schedule.source.startswith("default")


def test_letters_accepted_in_list():
    cfg = ModelConfig.from_dict(small_config(indexer_types=["F", "S", "F", "S"]))
    assert cfg.indexer_schedule.pattern == "FSFS"


def test_explicit_list_and_pattern_disagreeing_names_first_layer():
    with pytest.raises(ConfigError, match="disagree at layer 2"):
        ModelConfig.from_dict(small_config(indexer_types=["full", "full", "shared", "shared"],
                                           index_topk_pattern="FFFS"))


def test_pattern_longer_than_the_list_is_an_error_not_a_crash():
    with pytest.raises(ConfigError, match="disagree at layer 4"):
        ModelConfig.from_dict(small_config(indexer_types=["full", "full", "shared", "shared"],
                                           index_topk_pattern="FFSSF"))


def test_explicit_list_and_pattern_agreeing_is_fine():
    cfg = ModelConfig.from_dict(small_config(indexer_types=["full", "full", "shared", "shared"],
                                             index_topk_pattern="FFSS"))
    assert cfg.indexer_schedule.pattern == "FFSS"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(indexer_types=["full", "shared", "shared"]), "3 entries but num_hidden_layers=4"),
        (dict(indexer_types=None, index_topk_pattern="FSS"), "3 entries but num_hidden_layers=4"),
        (dict(indexer_types=["full", "partial", "shared", "shared"]), r"indexer_types\[1\]='partial'"),
        (dict(indexer_types=None, index_topk_pattern="FXSS"), r"index_topk_pattern\[1\]='X'"),
        (dict(indexer_types=["shared", "full", "full", "full"]), "layer 0 is 'shared' but must be 'full'"),
        (dict(indexer_types=None, index_topk_freq=0), "index_topk_freq=0"),
        (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types has 2 entries"),
    ],
)
def test_invalid_schedules_are_rejected_with_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(small_config(**overrides))


def test_other_model_type_refused_listing_supported():
    with pytest.raises(ConfigError, match="model_type='deepseek_v3' is not supported; dsaserve serves glm_moe_dsa, "
                                          "deepseek_v32"):
        ModelConfig.from_dict({**small_config(), "model_type": "deepseek_v3"})


def test_hf_overrides_patch_before_resolution():
    cfg = ModelConfig.from_dict(glm52(),
                                hf_overrides='{"indexer_types": null, "index_topk_pattern": "' + "F" * 78 + '"}')
    assert cfg.indexer_schedule.num_full == 78
    assert cfg.indexer_schedule.source == "index_topk_pattern"
    nested = ModelConfig.from_dict(glm52(), hf_overrides={"rope_parameters": {"rope_theta": 1000}})
    assert nested.rope.theta == 1000 and nested.rope.rope_type == "default"
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dict(glm52(), hf_overrides="{index_topk: 3")


def test_pinning_override_reproduces_the_schedule():
    cfg = ModelConfig.from_dict(glm52())
    pinned = ModelConfig.from_dict(glm52(), hf_overrides=cfg.indexer_schedule.hf_override())
    assert pinned.indexer_types == cfg.indexer_types


def test_mlp_layer_types_from_first_k_dense_replace():
    cfg = ModelConfig.from_dict(small_config(first_k_dense_replace=2))
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    explicit = ModelConfig.from_dict(small_config(mlp_layer_types=["sparse", "dense", "sparse", "dense"]))
    assert explicit.mlp_layer_types == ("sparse", "dense", "sparse", "dense")


def test_yarn_rope_matches_transformers():
    from transformers import GlmMoeDsaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    raw = small_config(rope_parameters=rope, max_position_embeddings=4096)
    cfg = ModelConfig.from_dict(raw)
    ref_cfg = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](ref_cfg, "cpu")
    inv, factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    assert torch.allclose(inv, ref_inv) and math.isclose(factor, ref_factor)
    mscale = 0.1 * math.log(4.0) + 1.0
    assert math.isclose(attention_scale(cfg.qk_head_dim, cfg.rope), cfg.qk_head_dim**-0.5 * mscale**2)


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(small_config(eos_token_id=5)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == (5, 9)


def test_missing_config_json_names_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_model_construction_rejects_shared_layer_without_producer():
    cfg = ModelConfig.from_dict(small_config())
    object.__setattr__(cfg, "indexer_schedule",
                       cfg.indexer_schedule.__class__(("shared", "full", "full", "full"), "test"))
    with torch.device("meta"), pytest.raises(ValueError, match="no full layer before it|there is none"):
        GlmMoeDsaForCausalLM(cfg)


def test_rotary_table_rows_equal_the_direct_computation():
    """cos_sin with `upto` reads rows of a table made once (and grown for longer positions): the same
    values as computing the given positions directly, yarn scaling included."""
    from dsaserve.model.layers import RotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    cfg = ModelConfig.from_dict(small_config(rope_parameters=rope, max_position_embeddings=16384))
    rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
    for positions in ([0, 3, 4095], [9000, 1, 5000]):  # the second needs a larger table
        positions = torch.tensor(positions)
        for dtype in (torch.float32, torch.bfloat16):
            looked_up = rotary.cos_sin(positions, dtype, int(positions.max()) + 1)
            direct = rotary.cos_sin(positions, dtype)
            assert all(torch.equal(a, b) for a, b in zip(looked_up, direct))
    assert rotary._table[0].shape[0] == 16384
