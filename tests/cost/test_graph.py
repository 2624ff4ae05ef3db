"""Traced-graph pricing: blocks, the tp region, saved activations against Korthikanti."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.estimate import ShapeModel
from cost.graph import GraphModel
from cost.hardware import GPU
from cost.model import ModelShape
from cost.symbolic import formulas
from cost.workload import activation_bytes

B, S, H, A, V, LAYERS = 2, 32, 48, 4, 64, 3


class MegatronBlock(nn.Module):
    """GPT layer as in Korthikanti et al.: explicit softmax attention with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.ones(S, S, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (z.view(b, s, A, h // A).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(h, -1))  # fmt: skip
        scores = (q @ k.transpose(-2, -1) / math.sqrt(h // A)).masked_fill(self.mask, -1e4)
        y = self.drop(torch.softmax(scores, -1)) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, block=MegatronBlock) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def traced() -> GraphModel:
    model = TinyGPT().to(torch.bfloat16).train()
    ids = torch.zeros(B, S, dtype=torch.long)
    return GraphModel.from_traced(torch.export.export(model, (ids,), strict=False))


def test_blocks_heads_and_parameters(traced):
    assert (traced.layers, traced.heads, traced.kv_heads, traced.seq, traced.batch) == (
        LAYERS, 0, 0, S, B)  # fmt: skip
    layer = 12 * H * H + 13 * H
    assert traced.params == {"pre": V * H, "block": LAYERS * layer, "post": 2 * H + V * H}
    assert traced.comm["tp_calls"] == 2  # attention projection and fc2: the row linears
    assert traced.comm["tp_bytes"] == 2 * B * S * H


def test_saved_activations_match_korthikanti(traced):
    """Graph-derived bytes per layer = s·b·h·(34 + 5·a·s/h) + the LayerNorms' fp32 mean/rstd."""
    korthikanti = formulas()["activations_per_layer"].evaluate(s=S, b=B, h=H, a=A)
    stats = 2 * 8 * S * B
    saved = traced.saved
    per_layer = (saved["inner"] + saved["outer"] + saved["core"]) / LAYERS
    assert per_layer == korthikanti + stats
    assert saved["inner"] / LAYERS == 24 * S * B * H  # inside the tp region: ÷t
    assert saved["core"] / LAYERS == 5 * A * S * S * B  # what selective recompute drops
    assert saved["inputs"] / LAYERS == 2 * S * B * H  # what full recompute keeps


@pytest.mark.parametrize("t", [1, 2, 4])
def test_workload_activations_follow_korthikanti_under_tp(traced, t):
    gpu = GPU.preset("a100-80gb")
    f = formulas()
    stats = 2 * 8 * S * B
    plain = traced.workload(ParallelConfig(tp=t, global_batch=B, sequence_parallel=False), B, gpu)
    expected = f["activations_per_layer_tp"].evaluate(s=S, b=B, h=H, a=A, t=t)
    assert plain.act_bytes["none"] == pytest.approx(expected + stats)
    sp = traced.workload(ParallelConfig(tp=t, global_batch=B), B, gpu)
    expected_sp = f["activations_per_layer_tp_sp"].evaluate(s=S, b=B, h=H, a=A, t=t)
    assert sp.act_bytes["none"] == pytest.approx(expected_sp + stats / t)
    selective = f["activations_per_layer_selective"].evaluate(s=S, b=B, h=H, t=t)
    assert sp.act_bytes["selective"] == pytest.approx(selective + stats / t)
    assert sp.act_bytes["full"] == pytest.approx(2 * S * B * H / t)


def test_workload_scales_with_micro_batch_and_tp(traced):
    gpu = GPU.preset("h100-sxm")
    one = traced.workload(ParallelConfig(tp=1, global_batch=8), 2, gpu)
    two = traced.workload(ParallelConfig(tp=1, global_batch=8), 4, gpu)
    assert two.act_bytes["none"] == pytest.approx(2 * one.act_bytes["none"])
    assert two.tp_bytes == pytest.approx(2 * one.tp_bytes)
    tp2 = traced.workload(ParallelConfig(tp=2, global_batch=8), 2, gpu)
    assert tp2.layer_dense_params == pytest.approx(one.layer_dense_params / 2)
    assert tp2.boundary_bytes == pytest.approx(one.boundary_bytes / 2)


def test_forward_flops_per_token_match_the_graph(traced):
    layer_matmuls = 2 * 12 * H * H + 4 * S * H  # weights + QKᵀ and PV (no causal skip here)
    head = 2 * H * V
    palm, megatron = traced.flops_per_token()
    elementwise = palm / 3 - LAYERS * layer_matmuls - head
    assert 0 < elementwise < 0.05 * palm / 3  # norms, softmax, GeLU: a few FLOPs per element
    assert megatron > palm


@pytest.mark.parametrize("option,value", [("attention", "unfused"), ("attention", "flash1"),
                                          ("gemm_bytes", 1), ("kernels", "eager"),
                                          ("loss_kernels", "eager"), ("selective", "matmuls"),
                                          ("checkpoint_every", 2)])  # fmt: skip
def test_a_shape_only_option_on_a_traced_model_is_an_error_not_ignored(traced, option, value):
    """A traced graph is priced from its own ops: an option that describes a model shape's
    kernels (attention kernel, FP8 GEMMs, eager ops, recompute policy) would change nothing,
    so it is refused by name (was: the same price, silently), through the search too."""
    from cost.hardware import Cluster
    from cost.search import search

    cfg = ParallelConfig(global_batch=8, **{option: value})
    with pytest.raises(CostInputError, match=f"{option}=.*traced model.*leave {option}"):
        traced.workload(cfg, 2, GPU.preset("h100-sxm"))
    if option == "attention":
        from cost.search import SearchSpace

        with pytest.raises(CostInputError, match="attention='unfused' \\(--attention\\)"):
            search(traced, Cluster.preset("dgx-h100", nodes=1), 8,
                   space=SearchSpace(attention="unfused"))  # fmt: skip
    traced.workload(ParallelConfig(global_batch=8), 2, GPU.preset("h100-sxm"))  # defaults price


def test_untraced_module_is_a_clear_error():
    with pytest.raises(CostInputError, match="torch.export.export"):
        GraphModel.from_traced(TinyGPT())


def test_hf_llama_graph_matches_its_shape():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=512)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(2, 128, dtype=torch.long)
    traced = torch.export.export(model, (ids,), kwargs={"use_cache": False}, strict=False)
    graph = GraphModel.from_traced(traced)
    shape = ModelShape.llama(layers=4, hidden=256, heads=8, kv_heads=2, ffn=688, seq=128,
                             vocab=1000)  # fmt: skip
    assert sum(graph.params.values()) == shape.params
    assert (graph.layers, graph.heads, graph.seq, graph.batch) == (4, 8, 128, 2)
    assert graph.comm["tp_calls"] == 2  # o_proj and down_proj; rotary adds are not rows
    assert graph.comm["tp_bytes"] == 2 * 2 * 128 * 256
    cfg = ParallelConfig(tp=2, global_batch=8, micro_batch=2)
    work = graph.workload(cfg, 2, GPU.preset("h100-sxm"))
    ideal = activation_bytes(shape, cfg, 2)["none"]
    assert ideal < work.act_bytes["none"] < 2 * ideal  # eager RMSNorm keeps fp32 copies


def test_decomposed_graph_prices_the_same_work():
    model = TinyGPT().to(torch.bfloat16).train()
    traced = torch.export.export(model, (torch.zeros(B, S, dtype=torch.long),), strict=False)
    plain = GraphModel.from_traced(traced)
    lowered = GraphModel.from_traced(traced.run_decompositions())
    assert lowered.params == plain.params
    assert lowered.comm == plain.comm  # mm(x, t(w)) + view is still a row-parallel linear
    assert lowered.flops_per_token() == pytest.approx(plain.flops_per_token(), rel=0.01)


def test_saved_bytes_equal_what_autograd_saves_on_a_real_run():
    """Run the model eagerly and record every tensor autograd saves (by storage, parameters
    excluded); the graph-derived count must match it byte for byte, up to two documented CPU
    differences: CPU dropout keeps its mask as a bf16 multiplier (CUDA: 1-byte bool) and CPU
    LayerNorm keeps mean/rstd in bf16 (CUDA: fp32)."""
    torch.manual_seed(0)
    model = TinyGPT().to(torch.bfloat16).train()
    ids = torch.randint(0, V, (B, S))
    fixed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in fixed:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    graph = GraphModel.from_traced(torch.export.export(model, (ids,), strict=False))
    derived = sum(graph.saved[k] for k in ("inner", "outer", "core", "post"))
    masks = LAYERS * (2 * S * B * H + A * S * S * B)  # one more byte each on CPU
    norms = 2 * LAYERS + 1
    stats = norms * 2 * S * B * (2 - 4)  # mean and rstd per row: bf16 on CPU, fp32 on CUDA
    token_ids = B * S * 8  # int64 ids saved by the embedding, before the first layer
    assert sum(saved.values()) == derived + masks + stats + token_ids


def test_sdpa_is_priced_as_torch_runs_it_flash_attention_2_on_hopper():
    """autopar's rank programs call torch SDPA, whose default flash backend is
    FlashAttention-2 (FA3 is an opt-in prototype in torch 2.13): on an H100 its score GEMM's
    efficiency is capped at the GPU's `fa2_fraction` (0.35), on an A100 it is not; the
    graph's vectorised times and `node_time` agree."""
    from cost.compute import matmul_efficiency, node_efficiency, node_time

    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.zeros(1, 8, 1024, 128, dtype=torch.bfloat16)
    ep = torch.export.export(Attend(), (q, q, q), strict=False)
    node = next(n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target))
    h100, a100 = GPU.preset("h100-sxm"), GPU.preset("a100-80gb")
    shape_eff = matmul_efficiency(1024, 1024, 128)
    assert shape_eff > 0.35 == h100.fa2_fraction
    assert node_efficiency(node) == node_efficiency(node, a100) == shape_eff
    assert node_efficiency(node, h100) * h100.matmul_scale() == pytest.approx(0.35)
    assert node_time(node, h100) == pytest.approx(node_time(node, a100) * 312e12 / 989e12
                                                  * shape_eff / 0.35, rel=0.05)  # fmt: skip
    graph = GraphModel.from_traced(ep)
    row = int(next(i for i, s in enumerate(graph.arrays["sdpa"]) if s))
    for gpu in (h100, a100):
        assert graph.node_times(1.0, 1, gpu)[row] == pytest.approx(node_time(node, gpu), rel=1e-6)


def test_a_head_width_apart_from_hidden_over_heads_prices_as_the_traced_model():
    """Qwen3 sizes its heads apart from the hidden width (here 8 heads of 64 on a hidden 256):
    `ModelShape(head_size=64)` counts the traced model's parameters but the q/k norms (two
    vectors of d a layer) and its FLOPs per token; without it the shape prices heads of 32."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      vocab_size=1000, max_position_embeddings=512,
                                      tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(2, 128, dtype=torch.long)
    traced = torch.export.export(model, (ids,), kwargs={"use_cache": False}, strict=False)
    graph = GraphModel.from_traced(traced)
    dims = dict(layers=2, hidden=256, heads=8, kv_heads=2, ffn=688, seq=128, vocab=1000)
    shape = ModelShape.llama(**dims, head_size=64)
    assert sum(graph.params.values()) == shape.params + 2 * 2 * 64
    palm = ShapeModel(shape=shape).flops_per_token()[0]
    assert palm == pytest.approx(graph.flops_per_token()[0], rel=0.02)
    assert ModelShape.llama(**dims).params < shape.params
