"""Context parallelism on CPU Gloo ranks: ring overlap, and activation memory per rank vs cp.

Run from the repository root:  PYTHONPATH=. python benchmarks/bench_cp.py [--seq 1024]

Algorithm:
1. Overlap (cp = 2 and 4): every rank runs ring attention forward + backward on its local
   q, k, v [b, h, s/cp, d] with the exchanges overlapped (isend/irecv started before the block
   compute, waited after) and again with each exchange waited at once (blocking), and the
   same exchanges alone (no compute).  Hidden fraction = (blocking − overlapped) / exchanges
   alone, the share of ring communication that compute covered.  Median of REPEATS.  Also the
   overlapped ring with its exchanges as functional all-to-alls (what ``torch.compile``
   traces; ``cp_ops.FUNCTIONAL``) against ``batch_isend_irecv`` (what eager runs).
2. Memory (cp = 1, 2, 4): the tensors autograd saves for backward during one forward of the
   test Llama (unique storages, bytes), measured per rank with saved-tensor hooks, next to
   the plan's predicted activations per rank (every floating intermediate at its local shape:
   an upper bound) and both ratios to cp = 1.
3. Ring memory (cp = 2, 4): bytes one ring attention saves per rank, as the fused op, as the
   program runs it (one node per step, backward passing K/V around again), and with every
   step its own autograd node (saving its received K/V block and running o, lse).
Tests never assert on time; this prints ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from autopar import Mesh, autoparallelize
from autopar.ops import collectives, cp_ops
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, build, lm_loss, tokens

REPEATS = 5


def _qkv(rank: int, cp: int, shape: tuple) -> tuple[torch.Tensor, ...]:
    """This rank's query, key and value chunks (seeded by rank), with gradients."""
    b, h, s, d = shape
    g = torch.Generator().manual_seed(rank)
    return tuple(torch.randn(b, h, s // cp, d, generator=g, requires_grad=True) for _ in "qkv")


def _ring_times(rank: int, cp: int, port: int, shape: tuple, out: mp.SimpleQueue) -> None:
    with gloo_rank(rank, cp, port, (cp,), ("cp",)) as mesh:
        collectives.bind({"cp": mesh.get_group("cp")})
        _, _, s, d = shape
        q, k, v = _qkv(rank, cp, shape)

        def step() -> None:
            o = cp_ops.ring_attention(q, k, v, None, "cp", True, d**-0.5, s, True)
            o.sum().backward()

        def exchanges() -> None:
            for _ in range(cp - 1):
                cp_ops._Exchange([k.detach(), v.detach()], "cp", "fwd").result()
            for _ in range(2 * cp - 1):
                cp_ops._Exchange([k.detach(), v.detach()], "cp", "bwd").result()

        times = {}
        for name, fn, overlap, functional in (
                ("overlapped", step, True, False), ("blocking", step, False, False),
                ("exchanges alone", exchanges, True, False), ("functional", step, True, True)):
            cp_ops.OVERLAP, cp_ops.FUNCTIONAL = overlap, functional
            fn()  # warm-up
            runs = []
            for _ in range(REPEATS):
                torch.distributed.barrier()
                start = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - start)
            times[name] = statistics.median(runs)
        out.put((rank, times))


def overlap(seq: int) -> None:
    print("1. ring attention forward + backward per rank (median of "
          f"{REPEATS}; b=1, h=8, s={seq}, d=64)")  # fmt: skip
    print(f"{'cp':>3} {'overlapped':>12} {'blocking':>12} {'exch. alone':>12} "
          f"{'block/overlap':>14} {'hidden':>8} {'functional/p2p':>15}")  # fmt: skip
    for cp in (2, 4):
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_ring_times, args=(cp, free_port(), (1, 8, seq, 64), results), nprocs=cp)
        per = [results.get()[1] for _ in range(cp)]
        t = {k: max(p[k] for p in per) for k in per[0]}  # the slowest rank sets the step
        hidden = max(0.0, t["blocking"] - t["overlapped"]) / t["exchanges alone"]
        print(f"{cp:>3} {t['overlapped'] * 1e3:>10.2f}ms {t['blocking'] * 1e3:>10.2f}ms "
              f"{t['exchanges alone'] * 1e3:>10.2f}ms {t['blocking'] / t['overlapped']:>14.2f} "
              f"{min(hidden, 1.0):>8.0%} {t['functional'] / t['overlapped']:>15.2f}")  # fmt: skip


def _saved_bytes(rank: int, cp: int, port: int, c: Config, out: mp.SimpleQueue) -> None:
    with gloo_rank(rank, cp, port, (cp,), ("cp",)) as mesh:
        x, y = tokens(c)
        module = autoparallelize(build("llama", c), mesh, (x, y), lm_loss, cp_attention="ring")
        out.put((rank, measure_saved(lambda: module(x, y))))


def measure_saved(run) -> int:
    """Bytes of the distinct storages autograd saves during ``run()`` (its forward)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def memory(seq: int) -> None:
    c = Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=96, seq=seq, batch=1)
    x, y = tokens(c)
    model = build("llama", c)
    base = measure_saved(lambda: lm_loss(model(x), y))
    print(f"\n2. activations saved for backward per rank, test Llama 2 layers, seq {seq}")
    print(f"{'cp':>3} {'measured':>12} {'ratio':>7} {'predicted':>12} {'ratio':>7}")
    preds = {}
    for cp in (2, 4):
        prog = autoparallelize(build("llama", c), Mesh(cp=cp), (x, y), lm_loss, cp_attention="ring")
        note = next(n for n in prog.plan.notes if n.startswith("activations per rank"))
        preds[cp] = float(note.split()[3]) * 2**20
    pred1 = preds[2] * 2  # cp=1 holds the whole sequence: twice cp=2's split values
    print(f"{1:>3} {base / 2**20:>10.2f}MB {1.0:>7.2f} {pred1 / 2**20:>10.2f}MB {1.0:>7.2f}")
    for cp in (2, 4):
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_saved_bytes, args=(cp, free_port(), c, results), nprocs=cp)
        measured = max(results.get()[1] for _ in range(cp))
        print(f"{cp:>3} {measured / 2**20:>10.2f}MB {measured / base:>7.2f} "
              f"{preds[cp] / 2**20:>10.2f}MB {preds[cp] / pred1:>7.2f}")  # fmt: skip


class _SavingStep(torch.autograd.Function):
    """A ring step as its own autograd node (the design cp does not use): backward needs the
    step's K/V block and running (o, lse), so it saves them."""

    @staticmethod
    def forward(ctx, q, k, v, o, lse, step, shape):
        ctx.save_for_backward(q, k, v, *(t for t in (o, lse) if t is not None))
        b, h, s, d = shape
        return cp_ops.ring_block(q, k, v, None if o is None else o.clone(),
                                 None if lse is None else lse.clone(), None, "cp", step, True,
                                 d**-0.5, s, True)  # fmt: skip

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 7


def _ring_saved(rank: int, cp: int, port: int, shape: tuple, out: mp.SimpleQueue) -> None:
    with gloo_rank(rank, cp, port, (cp,), ("cp",)) as mesh:
        collectives.bind({"cp": mesh.get_group("cp")})
        _, _, s, d = shape
        q, k, v = _qkv(rank, cp, shape)

        def unrolled(saving: bool):
            block, o, lse = [k, v], None, None
            for step in range(cp):
                pending = cp_ops.ring_send(block, "cp") if step < cp - 1 else None
                if saving:
                    o, lse = _SavingStep.apply(q, *block, o, lse, step, shape)
                else:
                    o, lse = cp_ops.ring_block(q, *block, o, lse, None, "cp", step, True,
                                               d**-0.5, s, True)  # fmt: skip
                if pending is not None:
                    block = [t.requires_grad_() for t in cp_ops.ring_recv(pending)]
            if saving:
                return o
            return cp_ops.ring_attention_out(q, k, v, o, lse, None, "cp", True, d**-0.5, s, True)

        fused = measure_saved(lambda: cp_ops.ring_attention(q, k, v, None, "cp", True, d**-0.5,
                                                            s, True))  # fmt: skip
        ours = measure_saved(lambda: unrolled(False))
        per_step = measure_saved(lambda: unrolled(True))
        out.put((rank, (fused, ours, per_step)))


def ring_memory(seq: int) -> None:
    shape = (1, 8, seq, 64)
    print(f"\n3. bytes one ring attention saves for backward per rank (b=1, h=8, s={seq}, d=64, "
          "fp32; own q, k, v count)")  # fmt: skip
    print(f"{'cp':>3} {'fused op':>12} {'node/step':>12} {'saving steps':>13}")
    for cp in (2, 4):
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_ring_saved, args=(cp, free_port(), shape, results), nprocs=cp)
        per = [results.get()[1] for _ in range(cp)]
        fused, ours, steps = (max(p[i] for p in per) for i in range(3))
        print(f"{cp:>3} {fused / 2**20:>10.2f}MB {ours / 2**20:>10.2f}MB {steps / 2**20:>11.2f}MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    overlap(args.seq)
    memory(args.seq)
    ring_memory(args.seq)


if __name__ == "__main__":
    main()
