"""The Llama model: public dims, torchtitan names, RoPE against Meta's complex form, causality."""

import torch

from mx_recipe.models import flops_per_token, model_args
from mx_recipe.models.llama import LLAMA_FLAVORS, Transformer, apply_rope, rope_tables


def test_public_llama3_dims():
    # (dim, layers, heads, kv heads, FFN hidden) of Llama 3.2 1B, Llama 3.1 8B and 70B.
    expected = {"1B": (2048, 16, 32, 8, 8192), "8B": (4096, 32, 32, 8, 14336), "70B": (8192, 80, 64, 8, 28672)}
    for flavor, dims in expected.items():
        a = LLAMA_FLAVORS[flavor]
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden_dim) == dims
        assert a.rope_theta == 500000.0


def test_8b_parameter_count_on_meta():
    args = model_args("llama", "8B", vocab_size=128256, max_seq_len=8192)
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama 3.1 8B


def test_torchtitan_parameter_names():
    args = model_args("llama", "debug", vocab_size=320, max_seq_len=64)
    names = set(Transformer(args).state_dict())
    for n in (
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        "layers.3.attention.wq.weight",
        "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
    ):
        assert n in names
    assert not any("rope" in n for n in names)  # the RoPE tables are recomputed, not saved


def test_rope_matches_complex_form():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 4, 32)
    cos, sin = rope_tables(32, 16, 500000.0)
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    freqs_cis = torch.polar(torch.ones(16, 16), torch.outer(torch.arange(16).float(), freqs))
    xc = torch.view_as_complex(x.reshape(2, 16, 4, 16, 2))
    expected = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)


def test_forward_is_causal_and_init_is_deterministic():
    args = model_args("llama", "debug", vocab_size=320, max_seq_len=32)
    torch.manual_seed(1)
    a = Transformer(args)
    a.init_weights()
    torch.manual_seed(1)
    b = Transformer(args)
    b.init_weights()
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), na
    tokens = torch.randint(0, 320, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 320
    with torch.no_grad():
        out, out2 = a(tokens), a(changed)
    assert out.shape == (2, 32, 320)
    torch.testing.assert_close(out[:, :20], out2[:, :20])
    assert not torch.allclose(out[:, 20:], out2[:, 20:])


def test_flops_per_token_formula():
    args = model_args("llama", "8B", vocab_size=128256, max_seq_len=8192)
    with torch.device("meta"):
        model = Transformer(args)
    n = 8_030_261_248
    assert flops_per_token(args, model, 8192) == 6 * (n - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
