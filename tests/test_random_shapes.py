"""Random small HF causal LMs (GPT-2, OPT, Gemma, Llama, Mistral, Starcoder2, MPT) x batch 1-3
x sequence 5-33 (odd lengths included) x tp in {2, 4}: the per-rank programs run without a
crash and match the single-device model (outputs and every gradient, fp32).

A few derandomised examples run in CI.  ``AUTOPAR_SOAK=300`` runs 300 random cases instead,
keeps going past failures, and ends with a tally of cases, crashes and wrong answers by family.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from autopar import Mesh
from autopar.verify import verify

transformers = pytest.importorskip("transformers")

SOAK = int(os.environ.get("AUTOPAR_SOAK", "0"))
RTOL = 1e-5


@dataclass(frozen=True, kw_only=True)
class Case:
    family: str
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    ffn: int
    vocab: int
    batch: int
    seq: int
    tp: int


def _config(c: Case):
    T = transformers
    common = dict(vocab_size=c.vocab, use_cache=False)
    llama_like = dict(hidden_size=c.hidden, intermediate_size=c.ffn, num_hidden_layers=c.layers,
                      num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                      max_position_embeddings=64, **common)  # fmt: skip
    if c.family == "gpt2":
        return T.GPT2LMHeadModel, T.GPT2Config(n_embd=c.hidden, n_layer=c.layers, n_head=c.heads,
                                               n_inner=c.ffn, n_positions=64, **common)  # fmt: skip
    if c.family == "opt":
        return T.OPTForCausalLM, T.OPTConfig(hidden_size=c.hidden, num_hidden_layers=c.layers,
                                             num_attention_heads=c.heads, ffn_dim=c.ffn,
                                             word_embed_proj_dim=c.hidden,
                                             max_position_embeddings=64, **common)  # fmt: skip
    if c.family == "mpt":
        return T.MptForCausalLM, T.MptConfig(d_model=c.hidden, n_layers=c.layers, n_heads=c.heads,
                                             expansion_ratio=c.ffn // c.hidden, max_seq_len=64,
                                             **common)  # fmt: skip
    if c.family == "gemma":
        return T.GemmaForCausalLM, T.GemmaConfig(head_dim=c.hidden // c.heads, **llama_like)
    classes = {"llama": (T.LlamaForCausalLM, T.LlamaConfig),
               "mistral": (T.MistralForCausalLM, T.MistralConfig),
               "starcoder2": (T.Starcoder2ForCausalLM, T.Starcoder2Config)}  # fmt: skip
    model_cls, config_cls = classes[c.family]
    return model_cls, config_cls(**llama_like)


# A crash seen before collectives returned row-major tensors: logits all-gathered along the
# sequence then flattened to [batch * seq, vocab] by a `view` that was valid only globally.
VIEW_OF_GATHERED_SEQUENCE = Case(family="gemma", hidden=64, heads=2, kv_heads=1, layers=1,
                                 ffn=128, vocab=96, batch=3, seq=32, tp=2)  # fmt: skip

FAMILIES = ("gpt2", "opt", "gemma", "llama", "mistral", "starcoder2", "mpt")
GROUPED = ("gemma", "llama", "mistral", "starcoder2")  # families with a key/value head count


@st.composite
def cases(draw) -> Case:
    family = draw(st.sampled_from(FAMILIES))
    tp = draw(st.sampled_from([2, 4]))
    heads = draw(st.sampled_from([h for h in (2, 4) if h % tp == 0]))
    hidden = draw(st.sampled_from([32, 48, 64]))
    kv = (
        draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
        if family in GROUPED
        else heads
    )
    return Case(family=family, hidden=hidden, heads=heads, kv_heads=kv,
                layers=draw(st.integers(1, 2)), ffn=hidden * draw(st.sampled_from([2, 3, 4])),
                vocab=4 * draw(st.integers(16, 40)), batch=draw(st.integers(1, 3)),
                seq=draw(st.integers(5, 33)), tp=tp)  # fmt: skip


def outcome(c: Case) -> str:
    """'ok', or 'crash: ...' / 'wrong: ...' with the first line of the reason."""
    model_cls, config = _config(c)
    torch.manual_seed(0)
    model = model_cls(config).eval()  # no dropout: the ranks and the reference must agree
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, c.vocab, (c.batch, c.seq), generator=g) for _ in range(2))
    try:
        report = verify(model, Mesh(tp=c.tp), (ids,), example_kwargs={"labels": labels},
                        rtol=RTOL)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported as this case's outcome
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return f"crash: {type(exc).__name__}: {lines[-1] if lines else ''}"
    if not report.ok:
        return f"wrong: {report.max_rel_error:.2e}\n{report}"
    return "ok"


def test_random_hf_families_verify():
    failures: list[tuple[Case, str]] = []
    tally: Counter = Counter()

    @settings(max_examples=SOAK or 6, derandomize=not SOAK, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate] if SOAK else list(Phase))  # fmt: skip
    @given(cases())
    @example(VIEW_OF_GATHERED_SEQUENCE)
    def run(case: Case) -> None:
        result = outcome(case)
        tally[(case.family, result.split(":")[0])] += 1
        if SOAK:
            print(case, result.splitlines()[0], flush=True)
            if result != "ok":
                failures.append((case, result))
            return
        assert result == "ok", f"{case}\n{result}"

    run()
    if SOAK:
        summary = _summary(tally, failures)
        print(summary)
        assert not failures, summary


def _summary(tally: Counter, failures: list[tuple[Case, str]]) -> str:
    rows = [f"soak: {sum(tally.values())} cases"]
    for fam in FAMILIES:
        n = {k: tally[(fam, k)] for k in ("ok", "crash", "wrong")}
        rows.append(f"  {fam:<11} {sum(n.values()):4d} cases  {n['crash']:3d} crashes  "
                    f"{n['wrong']:3d} wrong")  # fmt: skip
    rows += [f"  {case}\n    {result.splitlines()[0]}" for case, result in failures]
    return "\n".join(rows)
