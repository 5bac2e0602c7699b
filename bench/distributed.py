"""FSDP2 training steps on 1 and 2 ranks (gloo, CPU): step time and bytes all-gathered, with the
weights gathered in full precision (FP32 master weights) or as FP8 blocks (``fp8_all_gather``).

Recipe ``jetrl`` (the recipe whose GEMMs read weights only as FP8 blocks), eager trainer, FP32
master weights, every decoder layer sharded and then the root, AdamW. Each rank trains on its own
``--batch`` x ``--seq`` tokens per step. Two models:

- ``smollm2``: the default model (SmolLM2-135M). Its 576-row projections split into 288-row
  shards, which cut a 128-row block, so over 2 ranks only gate/up (1536 rows) gather in FP8.
- ``aligned``: a random Llama of the same size class whose every projection has a multiple of
  256 rows, so over 2 ranks every linear weight gathers in FP8.

Bytes are what one rank receives per step (forward gathers plus the backward's re-gathers),
counted through FSDP2's ``set_custom_all_gather``; they are exact, not sampled. Step times are
medians over the timed steps of every round (rounds alternate the variants); the 1-rank row
gathers nothing (FSDP2 reads its one shard in place).

    python bench/distributed.py                        # both models, 3 rounds x 2 timed steps
    python bench/distributed.py --models aligned --rounds 1 --steps 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, command_line, table, write_result  # noqa: E402

MODELS = ("smollm2", "aligned")
# (ranks, gather): the 1-rank reference, then 2 ranks gathering FP32 or FP8 blocks
VARIANTS = ((1, "none"), (2, "fp32"), (2, "fp8"))
ALIGNED = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
               num_hidden_layers=12, vocab_size=49152, tie_word_embeddings=True)


def _model(name: str):
    if name == "smollm2":
        from jetrl_compile.models import load_model

        return load_model(dtype=torch.float32)[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**ALIGNED)).float()


def _rank(rank: int, world: int, store: str, args, model_name: str, gather: str, out: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    from torch.distributed.fsdp import fully_shard

    import jetrl_compile
    from jetrl_compile.runtime.sharding import count_all_gathers

    model = jetrl_compile.unify(_model(model_name).to(device), "jetrl", mode="eager")
    plan = jetrl_compile.fp8_all_gather(model) if gather == "fp8" else {}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(rank)).to(device)

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up (first all-gathers allocate FSDP2's buffers)
    times = []
    with count_all_gathers(model) as log:
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
    if rank == 0:
        root = sum(n for module, n in log.calls if module is model)
        torch.save({"times": times, "bytes_per_step": log.nbytes / args.steps, "root_bytes_per_step": root / args.steps,
                    "fp8_linears": sum(why is None for why in plan.values()), "linears": len(plan)}, out)
    dist.destroy_process_group()


def _run(args, model_name: str, world: int, gather: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args, model_name, gather, out), nprocs=world)
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant once")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank, NCCL (needs 2 GPUs; bench/gpu.sh runs it where there are)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the table")
    parser.add_argument("--result", default="distributed", help="name of the table (<out>/<name>.md)")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 GPUs (one per rank); this machine has {torch.cuda.device_count()}")

    rows = []
    for model_name in args.models:
        results = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for world, gather in VARIANTS:
                print(f"{model_name}: round {r + 1}/{args.rounds}, {world} rank(s), gather {gather}", flush=True)
                results[(world, gather)].append(_run(args, model_name, world, gather))
        full = results[(2, "fp32")][0]["bytes_per_step"]
        for world, gather in VARIANTS:
            runs = results[(world, gather)]
            median = statistics.median(t for res in runs for t in res["times"])
            nbytes, root = runs[0]["bytes_per_step"], runs[0]["root_bytes_per_step"]
            assert all(res["bytes_per_step"] == nbytes for res in runs), "gathered bytes changed between rounds"
            linears = f"{runs[0]['fp8_linears']} of {runs[0]['linears']}" if gather == "fp8" else "-"
            rows.append([model_name, world, gather, linears, f"{(nbytes - root) / 2**20:.1f}", f"{root / 2**20:.1f}",
                         f"{nbytes / full:.2f}" if world > 1 else "-", f"{median:.2f}",
                         f"{world * args.batch * args.seq / median:.0f}"])
    body = table(["model", "ranks", "all-gather", "linears in FP8", "MiB / step / rank: layers", "root",
                  "total vs FP32 gather", "step s (median)", "tokens/s (all ranks)"], rows)
    threads = " The 1-rank row runs 2 threads, each of 2 ranks 1." if args.device == "cpu" else ""
    body += (f"\n\nRecipe jetrl, eager trainer, FP32 master weights; {args.batch} x {args.seq} tokens per rank per "
             f"step on {args.device}; {args.rounds} rounds x {args.steps} timed steps per variant. 'layers': the "
             "decoder layers' gathers (linear weights and norms); 'root': the embedding, final norm and lm_head "
             f"(tied), which stay in FP32.{threads}")
    cmd = command_line(__file__)
    write_result(args.result, cmd, body, args.out)


if __name__ == "__main__":
    main()
