"""MoE and MLA model specs: presets against their model cards, parameter counts against an
independent matrix listing, and one-line errors naming the field."""

import pytest
import yaml

from autotune.errors import InputError
from autotune.specs.model import PRESETS, load_model, model_from_dict

# (total, its printed precision, active, its printed precision, source, what the card's active count
# includes). A card figure printed as "3.3B" means 3.25..3.35B: a preset passes where it is within 1%
# of the figure the card means (1% plus half its last printed digit).
CARDS = {
    "mixtral-8x7b": (46.7e9, 0.1e9, 12.9e9, 0.1e9, "mistral.ai/news/mixtral-of-experts: '46.7B total, 12.9B per token'", "all"),
    "mixtral-8x22b": (141e9, 1e9, 39e9, 1e9, "mistral.ai/news/mixtral-8x22b: '39B active out of 141B'", "all"),
    "qwen2-57b-a14b": (57.4e9, 0.1e9, 14e9, 1e9, "Qwen2 Technical Report (arXiv 2407.10671) Table 1", "all"),
    "qwen3-30b-a3b": (30.5e9, 0.1e9, 3.3e9, 0.1e9, "huggingface.co/Qwen/Qwen3-30B-A3B model card", "all"),
    "qwen3-235b-a22b": (235e9, 1e9, 22e9, 1e9, "huggingface.co/Qwen/Qwen3-235B-A22B model card", "all"),
    "deepseek-v3": (671e9, 1e9, 37e9, 1e9, "DeepSeek-V3 Technical Report (arXiv 2412.19437) abstract", "all"),
    # the gpt-oss card's Table 1 lists active = attention + 4 of 128 experts + the unembedding only
    "gpt-oss-120b": (116.83e9, 0.01e9, 5.13e9, 0.01e9, "OpenAI gpt-oss model card (2025-08-05) Table 1", "no input embedding"),
    "gpt-oss-20b": (20.91e9, 0.01e9, 3.61e9, 0.01e9, "OpenAI gpt-oss model card (2025-08-05) Table 1", "no input embedding"),
    # xAI gives no active count ("25% of the weights active on a given token")
    "grok-1": (314e9, 1e9, None, None, "x.ai/news/grok-os: '314B parameter Mixture-of-Experts'", "all"),
}


def _near(got: float, card: float, printed: float) -> bool:
    return abs(got - card) <= 0.01 * card + printed / 2


@pytest.mark.parametrize("name", sorted(CARDS))
def test_presets_match_their_model_cards(name):
    total, tp_, active, ap, _, counts = CARDS[name]
    m = PRESETS[name]
    assert _near(m.total_params(), total, tp_), (name, m.total_params())
    if active is not None:
        got = m.active_params() - (m.embedding_params() if counts == "no input embedding" else 0)
        assert _near(got, active, ap), (name, got)


def _count_by_matrices(m) -> tuple[int, int]:
    """(total, active), listing every matrix of every layer from the config the way the HF modules
    build them (independent of ModelSpec's own arithmetic)."""
    h, a = m.hidden, m.heads
    if m.mla is None:
        hd = m.explicit_head_dim or h // a
        attn = [(h, a * hd), (h, m.kv_heads * hd), (h, m.kv_heads * hd), (a * hd, h)]
        # HF's q/k/v/o projections carry a bias of their output width (GPT-OSS: attention_bias)
        attn_n = sum(x * y + (y if m.bias else 0) for x, y in attn)
    else:
        x = m.mla
        qk = x.qk_nope_head_dim + x.qk_rope_head_dim
        q = h * x.q_lora_rank + x.q_lora_rank + x.q_lora_rank * a * qk if x.q_lora_rank else h * a * qk
        attn_n = q + h * (x.kv_lora_rank + x.qk_rope_head_dim) + x.kv_lora_rank \
            + x.kv_lora_rank * a * (x.qk_nope_head_dim + x.v_head_dim) + a * x.v_head_dim * h
    attn_n += a if m.sinks else 0  # GPT-OSS: one learned sink logit per head
    mats = 3 if m.activation == "swiglu" else 2

    def ffn(f):  # HF GptOssExperts: gate_up_proj_bias (2f) and down_proj_bias (h) per expert
        return mats * h * f + (((mats - 1) * f + h) if m.bias else 0)

    total = active = 0
    e = m.moe
    router = e.experts * h + (e.experts if m.bias else 0)  # GptOssTopKRouter: a Linear with bias
    for i in range(m.layers):
        base = attn_n + 2 * h
        if i in e.dense_layers:
            f = ffn(e.dense_ffn_hidden or m.ffn_hidden)
            total, active = total + base + f, active + base + f
        else:
            shared = e.shared_experts * ffn(e.shared_ffn_hidden) if e.shared_experts else 0
            one = ffn(e.expert_ffn_hidden)
            total += base + shared + router + e.experts * one
            active += base + shared + router + e.top_k * one
    rest = m.vocab * h * (1 if m.tied_embeddings else 2) + h
    return total + rest, active + rest


MOE_PRESETS = sorted(n for n, m in PRESETS.items() if m.moe is not None)


def test_every_moe_preset_is_listed():
    assert set(MOE_PRESETS) >= {"mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b", "qwen3-30b-a3b",
                                "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "grok-1", "tiny-moe",
                                "tiny-moe-shared"}
    assert set(CARDS) <= set(MOE_PRESETS)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_counts_match_matrix_listing(name):
    m = PRESETS[name]
    assert (m.total_params(), m.active_params()) == _count_by_matrices(m)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_model_file_round_trip(tmp_path, name):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(PRESETS[name].to_dict()))
    assert load_model(p) == PRESETS[name]


def test_dense_dict_has_no_new_keys():
    d = PRESETS["llama3-8b"].to_dict()
    assert not {"moe", "mla", "head_dim", "explicit_head_dim"} & set(d)


def test_one_expert_top_one_counts_as_the_dense_model():
    dense = PRESETS["tiny"].to_dict()
    m = model_from_dict({**dense, "moe": {"experts": 1, "top_k": 1, "expert_ffn_hidden": dense["ffn_hidden"]}})
    router = m.hidden  # one router column is the only addition
    assert m.total_params() == PRESETS["tiny"].param_count() + m.layers * router
    assert m.active_params() == m.total_params()
    assert m.model_flops_per_token(512) == pytest.approx(
        PRESETS["tiny"].model_flops_per_token(512) + 3 * 2 * m.layers * router)


def test_active_flops_count_top_k_experts():
    m = PRESETS["qwen3-30b-a3b"]
    e = m.moe
    routed_all = m.layers * 3 * m.hidden * e.expert_ffn_hidden * e.experts
    routed_active = m.layers * 3 * m.hidden * e.expert_ffn_hidden * e.top_k
    # short sequences: 6 x (active matmul parameters), Kaplan's rule with the experts a token uses
    matmul = m.active_params() - m.embedding_params() - m.layers * 2 * m.hidden - m.hidden
    assert m.model_flops_per_token(1) == pytest.approx(6 * matmul, rel=1e-3)
    assert m.total_params() - m.active_params() == routed_all - routed_active


BASE = {"name": "x", "layers": 4, "hidden": 64, "heads": 8, "ffn_hidden": 128, "vocab": 256}


@pytest.mark.parametrize("moe,field", [
    ({"experts": 8, "top_k": 10, "expert_ffn_hidden": 64}, "moe.top_k"),
    ({"experts": 0, "top_k": 1, "expert_ffn_hidden": 64}, "moe.experts"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "dense_layers": [0, 4]}, "moe.dense_layers"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "dense_layers": [0, 1, 2, 3]}, "moe.dense_layers"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "first_dense": 1, "dense_layers": [0]}, "moe.first_dense"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "shared_experts": 1}, "moe.shared_ffn_hidden"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "topk": 2}, "moe"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "router": {"dropless": False}}, "moe.router.capacity_factor"),
    ({"experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "router": {"score": "relu"}}, "moe.router.score"),
])
def test_bad_moe_fields_are_one_line_errors_naming_the_field(moe, field):
    with pytest.raises(InputError) as e:
        model_from_dict({**BASE, "moe": moe}, source="m.yaml")
    assert e.value.field == field and "\n" not in str(e.value)
    assert str(e.value).startswith(f"m.yaml: {field}:")


def test_bad_mla_field_is_named():
    with pytest.raises(InputError) as e:
        model_from_dict({**BASE, "mla": {"kv_lora_rank": 0, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                         "v_head_dim": 8}})
    assert e.value.field == "mla.kv_lora_rank"


def test_models_command_shows_total_and_active():
    import json

    from helpers.cli import run_autotune

    r = run_autotune("models", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    for name, m in PRESETS.items():
        assert (rows[name]["params"], rows[name]["active_params"]) == (m.total_params(), m.active_params())
    assert rows["qwen3-30b-a3b"]["experts"] == "128 top-8"
    assert rows["llama3-8b"]["active_params"] == rows["llama3-8b"]["params"]
