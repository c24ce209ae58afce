#!/usr/bin/env python3
"""Data-parallel inference throughput: eager vs. torch.compile(mode="reduce-overhead").

Each rank holds a full copy of the model and runs its own stream of requests,
padded up to a fixed set of batch buckets so CUDA graphs are recorded once
per bucket. At the end every rank's numbers are gathered and rank 0 writes a
CSV with per-rank and aggregate images/s, so slow GPUs / stragglers show up.

    torchrun --standalone --nproc_per_node=8 bench_reduce_overhead_infer.py \
        --model vit_large_patch16_224 --buckets 1 8 32 128 --csv results/vitl_h100x8.csv
"""
import argparse
import csv
import os
import socket
import statistics
import time

import timm
import torch
import torch._dynamo
import torch.distributed as dist


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_large_patch16_224")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=5, help="iterations per bucket before timing")
    p.add_argument("--iters", type=int, default=100, help="timed iterations per bucket")
    p.add_argument("--modes", nargs="+", default=["eager", "reduce-overhead"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--csv", default=None)
    return p.parse_args()


def pad_to_bucket(x, buckets):
    """Pad a batch up to the next bucket so the compiled graph sees a known shape."""
    n = x.size(0)
    b = next(b for b in buckets if b >= n)
    if b == n:
        return x, n
    pad = x.new_zeros((b - n, *x.shape[1:]))
    return torch.cat([x, pad], dim=0), n


def build_model(name, mode, dtype, device):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval().to(device=device, dtype=dtype)
    model = model.to(memory_format=torch.channels_last)
    if mode == "eager":
        return model
    return torch.compile(model, mode=mode)


@torch.inference_mode()
def bench_bucket(model, bucket, args, dtype, device, buckets):
    # requests arrive with a ragged size; pad them up to the bucket
    n_real = max(1, bucket - bucket // 4)
    x = torch.randn(n_real, 3, args.img_size, args.img_size, device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)

    for _ in range(args.warmup):  # first calls compile / record the CUDA graph for this shape
        torch.compiler.cudagraph_mark_step_begin()
        xb, n = pad_to_bucket(x, buckets)
        model(xb)[:n].float().softmax(-1)
    torch.cuda.synchronize(device)

    times = []
    start_all = time.perf_counter()
    for _ in range(args.iters):
        ev0 = torch.cuda.Event(enable_timing=True)
        ev1 = torch.cuda.Event(enable_timing=True)
        ev0.record()
        torch.compiler.cudagraph_mark_step_begin()
        xb, n = pad_to_bucket(x, buckets)
        # the graph's output buffer is overwritten on the next replay: take what we need now
        probs = model(xb)[:n].float().softmax(-1).clone()
        ev1.record()
        times.append((ev0, ev1))
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start_all
    lat_ms = [a.elapsed_time(b) for a, b in times]
    return {
        "bucket": bucket,
        "real_batch": n_real,
        "img_per_s": args.iters * n_real / wall,
        "p50_ms": statistics.median(lat_ms),
        "p99_ms": sorted(lat_ms)[int(0.99 * (len(lat_ms) - 1))],
        "checksum": float(probs.sum()),
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    buckets = sorted(args.buckets)

    rows = []
    for mode in args.modes:
        torch._dynamo.reset()
        model = build_model(args.model, mode, dtype, device)
        for bucket in buckets:
            # start every bucket together so the numbers are comparable across ranks
            dist.barrier()
            r = bench_bucket(model, bucket, args, dtype, device, buckets)
            r.update(mode=mode, rank=rank, host=socket.gethostname(), gpu=torch.cuda.get_device_name(device))
            rows.append(r)
        del model
        torch.cuda.empty_cache()

    # tiny per-rank summaries; all_gather_object pickles them through the current device
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)

    if rank == 0:
        all_rows = [r for per_rank in gathered for r in per_rank]
        for mode in args.modes:
            for bucket in buckets:
                sel = [r for r in all_rows if r["mode"] == mode and r["bucket"] == bucket]
                tput = [r["img_per_s"] for r in sel]
                slowest = min(sel, key=lambda r: r["img_per_s"])
                print(f"{mode:>16s} bucket {bucket:4d}: total {sum(tput):10.1f} img/s  "
                      f"per-rank {min(tput):8.1f}..{max(tput):8.1f}  p99 {max(r['p99_ms'] for r in sel):7.2f} ms  "
                      f"slowest rank {slowest['rank']} ({slowest['host']})", flush=True)
        if args.csv:
            os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(all_rows[0].keys()))
                w.writeheader()
                w.writerows(all_rows)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
