"""
Decoder-only LM pretraining on a packed-sequence corpus with a held-out split,
pipeline (1F1B) x FSDP2 x tensor parallel over a (pp, dp, tp) device mesh.

Run:
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        train_lm_holdout.py --pp 2 --tp 2 --data /data/packed/books_wiki_2048.npy
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler, random_split


class Packed(Dataset):
    """(N, seq_len + 1) int32 array of packed documents."""

    def __init__(self, path):
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        r = torch.from_numpy(self.rows[i].astype(np.int64))
        return r[:-1], r[1:]


class Attn(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.hd = d // nh
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d, nh, ff):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.RMSNorm(d), Attn(d, nh), nn.RMSNorm(d), Mlp(d, ff)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Stage(nn.Module):
    def __init__(self, cfg, idx, n):
        super().__init__()
        per = cfg["layers"] // n
        self.wte = nn.Embedding(cfg["vocab"], cfg["d"]) if idx == 0 else None
        self.wpe = nn.Embedding(cfg["seq"], cfg["d"]) if idx == 0 else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg["d"], cfg["heads"], cfg["ff"])
                                     for i in range(idx * per, (idx + 1) * per)})
        self.norm = nn.RMSNorm(cfg["d"]) if idx == n - 1 else None
        self.head = nn.Linear(cfg["d"], cfg["vocab"], bias=False) if idx == n - 1 else None

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for b in self.blocks.values():
            x = b(x)
        return self.head(self.norm(x)) if self.head is not None else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/data/runs/lm_holdout")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--val-frac", type=float, default=0.005)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    cfg = dict(vocab=50304, d=2048, layers=24, heads=16, ff=5504, seq=2048)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    full = Packed(args.data)
    n_val = int(len(full) * args.val_frac)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val])
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=2, drop_last=True)

    with torch.device("meta"):
        model = Stage(cfg, pp_rank, args.pp)
    tp = mesh["tp"]
    if model.head is not None:
        parallelize_module(model, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    for b in model.blocks.values():
        parallelize_module(b, tp, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                   "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                                   "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                                   "mlp.down": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks.values():
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=dev)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".n1." in n or ".n2." in n or n.startswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, args.pp, dev, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.micro,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt = os.path.join(args.out, "ckpt")
    start_epoch = 0
    if os.path.exists(os.path.join(ckpt, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "epoch": 0}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        start_epoch = sd["epoch"]

    def run(fn, x, y):
        losses = [] if last else None
        t = y.to(dev, non_blocking=True) if last else None
        if first:
            fn(x.to(dev, non_blocking=True), target=t, losses=losses)
        else:
            fn(target=t, losses=losses)
        return torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=dev)

    def reduce(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            opt.zero_grad(set_to_none=True)
            loss = run(schedule.step, x, y)
            opt.step()
            sched.step()
            if (i + 1) % 20 == 0:
                v = reduce(loss)
                if rank == 0:
                    print(f"epoch {epoch} it {i + 1}/{len(train_loader)} loss {v:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()

        model.eval()
        tot = torch.zeros((), device=dev)
        with torch.no_grad():
            for x, y in val_loader:
                tot += run(schedule.eval, x, y)
        v = reduce(tot / len(val_loader))
        if rank == 0:
            print(f"epoch {epoch} held-out loss {v:.4f} ppl {math.exp(v):.2f}", flush=True)

        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o, "sched": sched.state_dict(), "epoch": epoch + 1}, checkpoint_id=ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
