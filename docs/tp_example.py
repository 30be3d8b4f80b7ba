"""A tensor-parallel canary session under torchrun (docs/distributed.md).

Each rank runs its own KvCanary over its shard of a small KV pool; a TensorParallelAggregator
combines the ranks' reports once per step. After step 4 the last rank flips one byte of a cached
token in its shard: every rank logs the violation, naming that rank, in the same step.

    torchrun --nproc-per-node 2 docs/tp_example.py          # gloo, host tensors (CPU reference)
    torchrun --nproc-per-node 2 docs/tp_example.py --gpu    # NCCL, one GPU per rank
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist

import kvcanary as kc
from kvcanary.distributed import TensorParallelAggregator

SLOTS, BYTES, PROMPT = 256, 64, list(range(100, 108))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="NCCL and one GPU per rank (LOCAL_RANK)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK', 0)}] %(name)s: %(message)s")
    if args.gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if args.gpu else "gloo")  # the engine's process group
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local) if args.gpu else torch.device("cpu")

    k_shard = torch.zeros((SLOTS, BYTES), dtype=torch.uint8, device=dev)  # this rank's heads of the K pool
    canary = kc.KvCanary(kc.PoolGroup(SLOTS, k_sources=[kc.source_from_slots(k_shard)]),
                         device=local if args.gpu else None, mode="log", max_batch=4, verify_capacity=4096)
    agg = TensorParallelAggregator(canary, mode="log")  # group=None: the default (world) group

    req_to_token = torch.zeros((2, 64), dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(rank)
    length = 0
    for step in range(args.steps):
        new = PROMPT if step == 0 else [200 + step]      # prefill, then one decode token per step
        slots = list(range(1 + length, 1 + length + len(new)))
        req_to_token[1, length:length + len(new)] = torch.tensor(slots, dtype=torch.int32)
        ints = lambda xs: torch.tensor(list(xs), dtype=torch.int64, device=dev)  # noqa: E731
        batch = kc.Batch(req_pool_indices=ints([1]), prefix_lens=ints([length]), extend_lens=ints([len(new)]),
                         req_to_token=req_to_token, input_ids=ints(new),
                         positions=ints(range(length, length + len(new))), out_cache_loc=ints(slots))
        canary.before_forward(batch)
        k_shard[ints(slots)] = torch.randint(0, 256, (len(new), BYTES), dtype=torch.uint8, device=dev,
                                             generator=gen)  # the forward writes the new tokens' K
        canary.after_forward(batch)
        if rank == world - 1 and step == 4:
            k_shard[3, 0] ^= 1                           # a bit flip in a cached token of this shard
        agg.exchange()                                   # every rank, every step
        length += len(new)
    agg.flush()
    agg.health_check()
    s = agg.stats()
    if rank == 0:
        print(f"world_size={s['world_size']} exchanges={s['exchanges']} violations={s['violations']} "
              f"reported_here={s['reported']} verified_slots={s['verified_slots']} "
              f"source_ranks={sorted({r['rank'] for r in s['ranks'] if r['violations']})}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
