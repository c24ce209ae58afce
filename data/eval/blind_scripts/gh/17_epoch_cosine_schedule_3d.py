# Epoch-based pretraining of a 1.3B decoder on a fixed packed corpus (a few epochs),
# with pipeline (GPipe) x FSDP2 x TP over a 3D mesh.
#
#   torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
#       train_epochs.py --pp 2 --tp 2 --epochs 3
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
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def cosine_with_warmup(step, warmup, total, min_ratio=0.1):
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


class PackedRows(Dataset):
    def __init__(self, path):
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = torch.from_numpy(np.asarray(self.rows[i], dtype=np.int64))
        return r[:-1], r[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(B, T, -1, C // self.h).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LMStage(nn.Module):
    def __init__(self, vocab, d, h, layers, ctx, first, last):
        super().__init__()
        self.tok = nn.Embedding(vocab, d) if first else None
        self.pos = nn.Embedding(ctx, d) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(d, h) for i in layers})
        self.ln_f = nn.LayerNorm(d) if last else None
        self.head = nn.Linear(d, vocab, bias=False) if last else None

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))[None]
        for b in self.blocks.values():
            x = b(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="/nfs/data/packed_2048/train.npy")
    ap.add_argument("--val", default="/nfs/data/packed_2048/val.npy")
    ap.add_argument("--ckpt", default="/nfs/ckpt/lm1p3b_epochs")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup-frac", type=float, default=0.01)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    per = args.layers // args.pp
    with torch.device("meta"):
        model = LMStage(50304, args.d, args.heads, range(pp_rank * per, (pp_rank + 1) * per), args.ctx, first, last)
    tp = mesh["tp"]
    if last:
        parallelize_module(model, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    for b in model.blocks.values():
        parallelize_module(b, tp, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                   "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks.values():
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    torch.manual_seed(0)
    model.to_empty(device=device)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.reset_parameters()
            elif isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, args.microbatches,
                             loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))

    train_ds, val_ds = PackedRows(args.train), PackedRows(args.val)
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0,
                                       drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2, drop_last=True,
                            sampler=DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False,
                                                       drop_last=True))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps_per_epoch = len(train_ds) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    warmup = int(args.warmup_frac * total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, warmup, total_steps))

    start_epoch = 0
    if os.path.exists(os.path.join(args.ckpt, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "epoch": 0}
        dcp.load(sd, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        start_epoch = sd["epoch"]
    if rank == 0:
        print(f"dp={dp} total_steps={total_steps} warmup={warmup} start_epoch={start_epoch}", flush=True)

    def pipe(fn, x, y):
        losses = [] if last else None
        t = y.to(device, non_blocking=True) if last else None
        if first:
            fn(x.to(device, non_blocking=True), target=t, losses=losses)
        else:
            fn(target=t, losses=losses)
        return torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=device)

    def log_value(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            opt.zero_grad(set_to_none=True)
            loss = pipe(schedule.step, x, y)
            opt.step()
            sched.step()
            if i % 25 == 0:
                v = log_value(loss)
                if rank == 0:
                    print(f"ep {epoch} [{i}/{len(train_loader)}] loss {v:.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        model.eval()
        acc = torch.zeros((), device=device)
        with torch.no_grad():
            for x, y in val_loader:
                acc += pipe(schedule.eval, x, y)
        v = log_value(acc / len(val_loader))
        if rank == 0:
            print(f"ep {epoch} val loss {v:.4f} ppl {math.exp(v):.2f}", flush=True)

        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o, "sched": sched.state_dict(), "epoch": epoch + 1}, checkpoint_id=args.ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
