"""The `autopar` command line.

    autopar estimate --model llama3-70b --cluster dgx-h100 --nodes 8 --tp 8 --pp 4 --dp 2 \\
        --global-batch 512
    autopar plan --model llama3-70b --cluster dgx-h100 --nodes 64 --seq 8192 \\
        --global-batch 1024 --compare tp=8,pp=4,dp=16

Algorithm (`main`):
1. Parse the subcommand and its options; options left out stay None and are chosen by the
   estimator (micro-batch, schedule, virtual stages, recompute, dp).
2. Build the model shape (a preset, or gpt/llama dimensions from flags), the cluster (preset ×
   nodes, optionally with another GPU) and the parallel configuration,
   price them with `cost.estimate.estimate`, print the table (and with --explain the closed
   formulas behind it); exit 0 when it fits, 1 when it does not.
3. `plan` searches every configuration (`cost.search`) and prints the ranking
   (`autopar.planner.auto.render_plan`); `--compare` ranks a hand-chosen one too.
4. `--report FILE.html` / `--png DIR` also draw the estimate or the plan (`autopar.tools.report`).
5. Bad input (unknown preset, inconsistent degrees, a model that fits nowhere, a global batch
   no factorisation divides) prints the error and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from cost.config import ATTENTION, RECOMPUTE, SCHEDULES, ParallelConfig
from cost.errors import CostInputError
from cost.estimate import estimate
from cost.hardware import CLUSTER_PRESETS, GPU, GPU_PRESETS, Cluster
from cost.model import MODEL_PRESETS, ModelShape


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="price a training configuration")
    _model_args(est)
    for name in ("tp", "pp", "cp", "ep"):
        est.add_argument(f"--{name}", type=int, default=1)
    est.add_argument("--dp", type=int, help="default: GPUs left by tp·pp·cp")
    est.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    est.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    est.add_argument("--micro-batch", type=int)
    est.add_argument("--schedule", choices=SCHEDULES)
    est.add_argument("--virtual-stages", type=int)
    est.add_argument("--recompute", choices=RECOMPUTE)
    est.add_argument("--attention", choices=ATTENTION, default="flash")
    est.add_argument("--no-sequence-parallel", action="store_true")
    est.add_argument("--no-overlap", action="store_true", help="do not overlap dp reduction")
    est.add_argument("--tp-across-nodes", action="store_true")
    est.add_argument(
        "--grad-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="gradient precision (Megatron: fp32, 18 B/param; bf16: 16 B/param)",
    )
    est.add_argument("--fp8", action="store_true",
                     help="the linear layers' GEMMs in FP8 (priced at the GPU's FP8 peak, "
                     "casts included; autoparallelize(..., fp8=...))")  # fmt: skip
    est.add_argument("--explain", action="store_true", help="also print the closed formulas")
    _report_args(est)
    plan = sub.add_parser("plan", help="search every configuration; print the ranking")
    _model_args(plan)
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranking (default 10)")
    plan.add_argument("--compare", help="a hand-chosen configuration, e.g. tp=8,pp=4,dp=16")
    plan.add_argument("--zero", help="ZeRO stages to search, e.g. 0,1 (default 0,1,2,3)")
    plan.add_argument("--attention", choices=ATTENTION, default="flash")
    plan.add_argument(
        "--no-nest",
        action="store_true",
        help="keep Megatron's nesting (pp outermost, tp innermost)",
    )
    plan.add_argument(
        "--no-rails",
        action="store_true",
        help="the fabric is not rail-optimised (one leaf switch per node group)",
    )
    plan.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    plan.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                      help="FILE.py:FUNCTION models: traced with bf16 weights and inputs as "
                           "Mesh.auto under param_dtype=torch.bfloat16 (default), or fp32")  # fmt: skip
    plan.add_argument("--fp8", action="store_true",
                      help="price the linear layers' GEMMs in FP8 (a preset or shape's model)")
    _report_args(plan)
    return parser


def _report_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--report", metavar="HTML", help="also write the plan drawn as one HTML file")
    sub.add_argument("--png", metavar="DIR", help="also write each chart as DIR/<chart>.png")


def _write_report(obj: object, args: argparse.Namespace) -> None:
    """Step 4: the HTML report and the PNG charts asked for (`autopar.tools.report`)."""
    if args.report or args.png:
        from autopar.tools.report import figures_of, write_pngs, write_report
        from autopar.tools.report_facts import facts_of

        if args.report:
            print(f"report: {write_report(obj, args.report, png_dir=args.png)}")
        else:
            write_pngs(figures_of(facts_of(obj)), args.png)
        if args.png:
            print(f"charts: {args.png}/")


def _model_args(est: argparse.ArgumentParser) -> None:
    est.add_argument(
        "--model",
        help=f"one of {', '.join(sorted(MODEL_PRESETS))}, or 'gpt' / "
        "'llama' with --layers --hidden --heads --seq --vocab (llama: --kv-heads, "
        "--ffn, and for MoE --experts --top-k, --ffn then being each expert's); plan also takes FILE.py:FUNCTION returning (model, example_inputs[, loss_fn]) "
        "to trace (build it on the meta device for large models)",
    )
    for name in ("layers", "hidden", "heads", "vocab", "kv-heads", "ffn"):
        est.add_argument(f"--{name}", type=int)
    est.add_argument("--experts", type=int, default=1, help="llama: experts per MoE layer")
    est.add_argument("--top-k", type=int, default=1, help="llama: experts per token")
    est.add_argument("--head-size", type=int,
                     help="llama: width of one head where it is not hidden/heads (Qwen3)")
    est.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    est.add_argument("--cluster", default="dgx-h100", help=f"one of {', '.join(CLUSTER_PRESETS)}")
    est.add_argument("--gpu", help=f"replace the cluster's GPU: one of {', '.join(GPU_PRESETS)}")
    est.add_argument("--nodes", type=int, default=1)


def _config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, zero=args.zero,
        global_batch=args.global_batch, micro_batch=args.micro_batch, schedule=args.schedule,
        virtual_stages=args.virtual_stages, recompute=args.recompute, attention=args.attention,
        sequence_parallel=not args.no_sequence_parallel, overlap_grad_reduce=not args.no_overlap,
        tp_across_nodes=args.tp_across_nodes, grad_bytes=4 if args.grad_dtype == "fp32" else 2,
        gemm_bytes=1 if args.fp8 else 2,
    )  # fmt: skip


def _shape(args: argparse.Namespace) -> ModelShape:
    """A preset (optionally with another sequence length) or a shape built from the flags."""
    if args.model in ("gpt", "llama"):
        dims = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                "seq": args.seq, "vocab": args.vocab}  # fmt: skip
        if args.model == "llama":
            dims.update(kv_heads=args.kv_heads, ffn=args.ffn)
            if args.experts > 1:
                dims.update(experts=args.experts, top_k=args.top_k)
        missing = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is None]
        if missing:
            raise CostInputError(f"--model {args.model} needs {' '.join(missing)}")
        if args.model == "llama" and args.head_size:
            dims.update(head_size=args.head_size)
        build = ModelShape.gpt if args.model == "gpt" else ModelShape.llama
        return build(name=args.model, **dims)
    if args.model is None:
        raise CostInputError(
            f"--model is required: one of {', '.join(sorted(MODEL_PRESETS))}, or gpt / llama "
            "with its dimensions"
        )
    shape = ModelShape.preset(args.model)
    return shape.with_seq(args.seq) if args.seq else shape


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = Cluster.preset(args.cluster, nodes=args.nodes)
    return replace(cluster, gpu=GPU.preset(args.gpu)) if args.gpu else cluster


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    try:
        est = estimate(_shape(args), _cluster(args), _config(args))
    except CostInputError as err:
        print(f"autopar estimate: error: {err}", file=sys.stderr)
        return 2
    print(est)
    if args.explain:
        print()
        print(est.explain())
    _write_report(est, args)
    return 0 if est.fits else 1


def _plan(args: argparse.Namespace) -> int:
    import torch

    from autopar.planner.auto import load_traced, parse_degrees, plan_shape

    try:
        zero = tuple(int(z) for z in args.zero.split(",")) if args.zero else (0, 1, 2, 3)
        dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
        model = load_traced(args.model, dtype) if ":" in (args.model or "") else _shape(args)
        result = plan_shape(model, _cluster(args), args.global_batch, top=args.top,
                            compare=parse_degrees(args.compare) if args.compare else None,
                            zero=zero, attention=args.attention, nest=not args.no_nest,
                            rails=not args.no_rails,
                            grad_bytes=4 if args.grad_dtype == "fp32" else 2,
                            gemm_bytes=1 if args.fp8 else 2)  # fmt: skip
    except (CostInputError, ValueError) as err:
        print(f"autopar plan: error: {err}", file=sys.stderr)
        return 2
    print(result)
    _write_report(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
