"""
RWKV-7 (fla) on a tokenized corpus that fits in GPU memory (~1.5B tokens, uint16).

The token buffer lives on the GPU; each sample is a random window whose start is
snapped to the next document boundary, so most windows begin at a fresh document.

    torchrun --nproc_per_node=8 20_rwkv7_gpu_windows.py --tokens data/minipile_neox.u16
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from fla.models import RWKV7Config, RWKV7ForCausalLM


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--val_tokens", type=int, default=5_000_000)
    ap.add_argument("--ctx_len", type=int, default=4096)
    ap.add_argument("--eos_id", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--micro_bsz", type=int, default=8)
    ap.add_argument("--samples_per_epoch", type=int, default=400_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--lr_final", type=float, default=6e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--out", default="out/rwkv7_minipile")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class GPUWindowDataset(Dataset):
    """Random windows over a token buffer kept on the device."""

    def __init__(self, tokens, doc_starts, ctx_len, n_samples, seed):
        self.tokens = tokens          # 1-D int64 tensor on cuda
        self.doc_starts = doc_starts  # sorted 1-D int64 tensor on cuda
        self.ctx_len = ctx_len
        self.n_samples = n_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n_samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed + self.epoch * self.n_samples + i)
        hi = self.tokens.numel() - self.ctx_len - 1
        pos = int(torch.randint(0, hi, (1,), generator=g))
        j = torch.searchsorted(self.doc_starts, torch.tensor([pos], device=self.doc_starts.device))
        if j < self.doc_starts.numel() and int(self.doc_starts[j]) < hi:
            pos = int(self.doc_starts[j])
        return self.tokens[pos:pos + self.ctx_len + 1]


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * math.exp(frac * math.log(args.lr_final / args.lr))


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    arr = np.fromfile(args.tokens, dtype=np.uint16)
    all_tokens = torch.from_numpy(arr.astype(np.int64)).to(device)
    val_tokens = all_tokens[-args.val_tokens:]
    train_tokens = all_tokens[:-args.val_tokens]
    doc_starts = (train_tokens == args.eos_id).nonzero(as_tuple=True)[0] + 1

    # disjoint sample streams per rank via the seed
    train_ds = GPUWindowDataset(train_tokens, doc_starts, args.ctx_len,
                                args.samples_per_epoch // world, args.seed + 7919 * rank)
    loader = DataLoader(train_ds, batch_size=args.micro_bsz, shuffle=False, num_workers=4,
                        drop_last=True)

    torch.manual_seed(args.seed)
    cfg = RWKV7Config(hidden_size=args.hidden, num_hidden_layers=args.layers, head_dim=args.head_dim,
                      vocab_size=50304, fuse_cross_entropy=True, use_cache=False)
    model = RWKV7ForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-18,
                            weight_decay=0.001)
    total_steps = args.epochs * len(loader)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train tokens {train_tokens.numel() / 1e9:.2f}B, {len(loader)} steps/epoch/rank, "
              f"world {world}", flush=True)

    # fixed validation windows, strided across ranks
    n_val = (val_tokens.numel() - 1) // args.ctx_len
    val_starts = torch.arange(rank, n_val, world, device=device) * args.ctx_len

    step = 0
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in loader:
            batch = batch.to(device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total_steps, args)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                l = out.loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 50 * args.micro_bsz * args.ctx_len * world / (time.time() - t0)
                    print(f"ep {epoch} step {step} loss {l.item():.4f} "
                          f"lr {lr_at(step, total_steps, args):.2e} {tps / 1e3:.0f}k tok/s", flush=True)
                t0 = time.time()

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for k in range(0, val_starts.numel(), args.micro_bsz):
                starts = val_starts[k:k + args.micro_bsz]
                idx = starts[:, None] + torch.arange(args.ctx_len + 1, device=device)[None]
                vb = val_tokens[idx]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model.module(input_ids=vb[:, :-1]).logits
                acc[0] += F.cross_entropy(logits.float().flatten(0, 1), vb[:, 1:].flatten(), reduction="sum")
                acc[1] += vb[:, 1:].numel()
        dist.all_reduce(acc)
        if rank == 0:
            vl = (acc[0] / acc[1]).item()
            print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
