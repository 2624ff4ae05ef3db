"""`autopar estimate` command line."""

from __future__ import annotations

from autopar.tools.cli import main


def test_estimate_prints_the_table(capsys):
    argv = ["estimate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
            "--tp", "8", "--pp", "4", "--dp", "2", "--global-batch", "512"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("estimate: llama3-70b on 8 × 8 h100-sxm (64 GPUs)")
    assert "tp=8 pp=4 dp=2" in out and "tokens/s" in out
    assert "why:" not in out


def test_explain_flag_prints_formulas(capsys):
    argv = ["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128",
            "--tp", "8", "--pp", "8", "--global-batch", "1536", "--explain"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tp_traffic_per_layer = 8*b*h*s*(t - 1)/t" in out


def test_not_fitting_exits_one(capsys):
    argv = ["estimate", "--model", "llama3-405b", "--tp", "8", "--global-batch", "8"]
    assert main(argv) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_input_exits_two_with_the_reason(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--tp", "8", "--dp", "2", "--global-batch", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: tp·pp·dp·cp = 8·1·2·1 = 16 but the cluster has 8 GPUs" in err


def test_custom_shape_and_gpu(capsys):
    argv = ["estimate", "--model", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32",
            "--kv-heads", "8", "--ffn", "14336", "--seq", "8192", "--vocab", "128256",
            "--gpu", "b200", "--tp", "2", "--global-batch", "64"]  # fmt: skip
    assert main(argv) == 0
    assert "estimate: llama on 1 × 8 b200 (8 GPUs)" in capsys.readouterr().out


def test_head_size_flag_widens_the_heads(capsys):
    """Qwen3's 32 heads of 128 on a hidden of 2048: `--head-size` prices the 4096-wide query
    projection (more weights than heads of 64); heads that do not divide the hidden width
    need it."""
    argv = ["estimate", "--model", "llama", "--layers", "8", "--hidden", "2048", "--heads", "32",
            "--kv-heads", "4", "--ffn", "6144", "--seq", "4096", "--vocab", "151936",
            "--tp", "1", "--dp", "8", "--global-batch", "8"]  # fmt: skip
    weights = {}
    for extra in ([], ["--head-size", "128"]):
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        weights[bool(extra)] = float(next(line for line in out.splitlines()
                                          if line.strip().startswith("weights")).split()[-1])  # fmt: skip
    assert weights[True] > weights[False]
    odd = argv[:7] + ["--heads", "24"] + argv[9:]
    assert main(odd) == 2 and "(or give head_size)" in capsys.readouterr().err
    assert main(odd + ["--head-size", "128"]) == 0


def test_custom_shape_names_missing_dimensions(capsys):
    argv = ["estimate", "--model", "gpt", "--layers", "4", "--global-batch", "8"]
    assert main(argv) == 2
    assert "--model gpt needs --hidden --heads --seq --vocab" in capsys.readouterr().err


def test_missing_model_lists_presets(capsys):
    assert main(["estimate", "--global-batch", "8"]) == 2
    assert "--model is required: one of gpt3-175b, llama3-405b" in capsys.readouterr().err


def _compute_s(out: str) -> float:
    return float(next(line for line in out.splitlines() if line.strip().startswith("compute")).split()[-1])


def test_fp8_flag_prices_the_gemms_at_the_fp8_peak(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
            "--tp", "2", "--global-batch", "64"]  # fmt: skip
    assert main(argv) == 0
    bf16 = _compute_s(capsys.readouterr().out)
    assert main([*argv, "--fp8"]) == 0
    fp8 = _compute_s(capsys.readouterr().out)
    assert 0.5 * bf16 < fp8 < 0.9 * bf16  # the GEMMs at 2x the peak; attention, casts and the rest not


def test_plan_fp8_flag_searches_with_fp8_gemms(capsys):
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
            "--global-batch", "64", "--top", "1"]  # fmt: skip
    best = []
    for extra in ([], ["--fp8"]):
        assert main([*argv, *extra]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["1"])
        best.append(float(row.split()[1]))
    assert best[1] < 0.9 * best[0]


_TINY = '''from autopar.tools.testing import Config, build, lm_loss, tokens


def make():
    c = Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=4,
               bias=False)
    return build("llama", c), tokens(c), lm_loss
'''


def test_plan_prices_a_traced_model_in_its_param_dtype(tmp_path, capsys):
    """`autopar plan --model FILE.py:FUNCTION` traces the model as Mesh.auto does under
    ``param_dtype``: bf16 by default (its saved activations half the fp32 trace's), fp32 by
    option."""
    import torch

    from autopar.planner.auto import load_traced

    (tmp_path / "tiny.py").write_text(_TINY)
    spec = f"{tmp_path / 'tiny.py'}:make"
    fp32, bf16 = load_traced(spec), load_traced(spec, torch.bfloat16)
    assert load_traced(spec, torch.float32).saved == fp32.saved
    assert bf16.saved["outer"] == fp32.saved["outer"] / 2 and bf16.saved["inner"] < fp32.saved["inner"]
    for dtype in ("bf16", "fp32"):
        argv = ["plan", "--model", spec, "--cluster", "dgx-h100", "--nodes", "1",
                "--global-batch", "4", "--param-dtype", dtype]  # fmt: skip
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith("plan: Llama on 1 × 8 h100-sxm")


def test_attention_flash1_prices_a_measured_kernel_where_one_is_published(capsys):
    """--attention flash1 prices FlashAttention v1 at its published throughput: on an A100
    node the attention (and so the step) is slower than the default fused kernel's; on B200,
    where no measurement is published, `estimate` and `plan` exit 2 saying so."""
    shape = ["--model", "llama3-8b", "--nodes", "1", "--global-batch", "16"]
    steps = []
    for extra in ([], ["--attention", "flash1"]):
        assert main(["estimate", *shape, "--cluster", "dgx-a100", "--dp", "8", *extra]) == 0
        steps.append(_compute_s(capsys.readouterr().out))
    assert steps[1] > steps[0]
    for cmd in ("estimate", "plan"):
        assert main([cmd, *shape, "--cluster", "dgx-b200", "--attention", "flash1"]) == 2
        assert "no published measurement of FlashAttention v1 on b200" in capsys.readouterr().err


def test_plan_refuses_shape_only_flags_on_a_traced_model(tmp_path, capsys):
    """--attention and --fp8 price a model shape's kernels; on a traced model they would
    change nothing (they did, silently, before), so `plan` exits 2 naming the flag."""
    (tmp_path / "tiny.py").write_text(_TINY)
    argv = ["plan", "--model", f"{tmp_path / 'tiny.py'}:make", "--cluster", "dgx-h100",
            "--nodes", "1", "--global-batch", "4"]  # fmt: skip
    for extra, named in ((["--attention", "unfused"], "--attention"), (["--fp8"], "--fp8")):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert named in err and "traced model" in err and "ignored" in err


def test_an_moe_estimate_says_its_step_time_is_optimistic(capsys):
    """benchmarks/fidelity.py's MoE rows miss by 2.5-3.4x: the printed step says so, a dense
    one does not."""
    shape = ["--model", "llama", "--layers", "4", "--hidden", "1024", "--heads", "8",
             "--kv-heads", "8", "--ffn", "512", "--seq", "1024", "--vocab", "32000",
             "--global-batch", "64"]  # fmt: skip
    assert main(["estimate", *shape, "--experts", "8", "--top-k", "2", "--ep", "8"]) == 0
    moe = capsys.readouterr().out
    assert main(["estimate", *shape]) == 0
    dense = capsys.readouterr().out
    steps = [out.split("step time (s)")[1].split("throughput")[0] for out in (moe, dense)]
    assert "MoE: optimistic" in steps[0] and "Qwen3-30B-A3B" in steps[0]
    assert "MoE" not in dense
