"""Model presets against published parameter counts, and FLOP formulas against a direct count."""

import pytest

from autotune.errors import InputError
from autotune.specs.model import PRESETS, ModelSpec, load_model, model_from_dict

# Published totals: model cards / papers (see ModelSpec.source of each preset).
PUBLISHED = {
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "gpt3-175b": 174.6e9,
}


@pytest.mark.parametrize("name,published", sorted(PUBLISHED.items()))
def test_preset_parameter_counts_match_published(name, published):
    got = PRESETS[name].param_count()
    assert abs(got - published) / published < 0.01, (name, got)


def _count_by_matrices(m: ModelSpec) -> int:
    """Independent count: list every weight matrix shape of one block and sum."""
    hd = m.hidden // m.heads
    shapes = [(m.hidden, m.heads * hd), (m.hidden, m.kv_heads * hd), (m.hidden, m.kv_heads * hd),
              (m.heads * hd, m.hidden)]
    shapes += [(m.hidden, m.ffn_hidden)] * (2 if m.activation == "swiglu" else 1) + [(m.ffn_hidden, m.hidden)]
    block = sum(a * b for a, b in shapes)
    if m.bias:
        block += sum(b for _, b in shapes)
    block += 2 * m.hidden * (2 if m.norm == "layernorm" else 1)
    total = m.layers * block + m.vocab * m.hidden + m.hidden * (2 if m.norm == "layernorm" else 1)
    if not m.tied_embeddings:
        total += m.vocab * m.hidden
    if m.position == "learned":
        total += m.max_positions * m.hidden
    return total


@pytest.mark.parametrize("name", sorted(n for n, m in PRESETS.items() if m.moe is None))  # MoE: test_moe_spec
def test_param_count_matches_matrix_listing(name):
    assert PRESETS[name].param_count() == _count_by_matrices(PRESETS[name])


def test_flops_6n_rule_of_thumb_for_short_sequences():
    # For s << h, training FLOPs/token ~ 6 * (non-embedding params + LM head) (Kaplan et al. 2020).
    m = PRESETS["llama3-8b"]
    matmul_params = m.layers * (m.attention_params() + m.mlp_params()) + m.vocab * m.hidden
    assert m.model_flops_per_token(1) == pytest.approx(6 * matmul_params, rel=1e-3)


def test_attention_term_grows_linearly_with_sequence():
    m = PRESETS["llama3-8b"]
    d1 = m.model_flops_per_token(8192) - m.model_flops_per_token(4096)
    d2 = m.model_flops_per_token(12288) - m.model_flops_per_token(8192)
    assert d1 == pytest.approx(d2)
    # causal: 3 (fwd+bwd) * 2 matmuls * 2 FLOPs * hidden * layers * (delta keys / 2)
    assert d1 == pytest.approx(3 * 4 * m.hidden * m.layers * 4096 / 2)


def test_recompute_adds_forward_work_in_order():
    m = PRESETS["llama3-70b"]
    none, sel, full = (m.hardware_flops_per_token(8192, r) for r in ("none", "selective", "full"))
    assert none < sel < full
    assert full - none == pytest.approx(m.layers * (m.layer_matmul_flops_fwd() + m.layer_attention_flops_fwd(8192)))


def test_model_file_round_trip(tmp_path):
    m = PRESETS["llama3-8b"]
    import yaml

    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({k: v for k, v in m.to_dict().items()}))
    assert load_model(p) == m


@pytest.mark.parametrize("bad,field", [
    ({"layers": 2, "hidden": 64, "heads": 6, "ffn_hidden": 8, "vocab": 9}, "hidden"),
    ({"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 3, "ffn_hidden": 8, "vocab": 9}, "kv_heads"),
    ({"layers": -2, "hidden": 64, "heads": 8, "ffn_hidden": 8, "vocab": 9}, "layers"),
    ({"hidden": 64, "heads": 8, "ffn_hidden": 8, "vocab": 9}, "layers"),
    ({"layers": 2, "hidden": 64, "heads": 8, "ffn_hidden": 8, "vocab": 9, "activation": "relu"}, "activation"),
    ({"layers": 2, "hidden": 64, "heads": 8, "ffn_hidden": 8, "vocab": 9, "hiden": 3}, None),
])
def test_bad_model_fields_name_the_field(bad, field):
    with pytest.raises(InputError) as e:
        model_from_dict(bad, source="m.yaml")
    assert e.value.source == "m.yaml"
    if field:
        assert e.value.field == field


def test_unknown_preset_suggests():
    with pytest.raises(InputError, match="did you mean llama3-8b"):
        load_model("llama3-8")
