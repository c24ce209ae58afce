"""Very wide MLP head trained on frozen image features, with Megatron-style
tensor-parallel linears (hidden 65536) and data parallelism over TP groups.

    torchrun --nproc_per_node=8 16_tp_wide_mlp_probe.py --tp 4 \
        --train-feats feats/train_vitg.npy --train-labels feats/train_labels.npy \
        --val-feats feats/val_vitg.npy --val-labels feats/val_labels.npy
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Groups:
    pass


G = Groups()


def make_groups(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    G.tp, G.dp = tp, world // tp
    G.tp_rank, G.dp_rank = rank % tp, rank // tp
    for i in range(G.dp):
        grp = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if i == G.dp_rank:
            G.tp_group = grp
    for j in range(tp):
        grp = dist.new_group(list(range(j, world, tp)))
        if j == G.tp_rank:
            G.dp_group = grp


class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=G.tp_group)
        return g


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=G.tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Gather(torch.autograd.Function):
    """all-gather the last dim; backward keeps this rank's slice"""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(G.tp)]
        dist.all_gather(parts, x.contiguous(), group=G.tp_group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(G.tp, dim=-1)[G.tp_rank].contiguous()


class ColumnParallelLinear(nn.Module):
    def __init__(self, fin, fout, gather_output=False):
        super().__init__()
        w = torch.empty(fout, fin)
        nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        self.weight = nn.Parameter(w.chunk(G.tp, 0)[G.tp_rank].clone())
        self.bias = nn.Parameter(torch.zeros(fout // G.tp))
        self.gather_output = gather_output

    def forward(self, x):
        y = F.linear(Copy.apply(x), self.weight, self.bias)
        return Gather.apply(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, fin, fout):
        super().__init__()
        w = torch.empty(fout, fin)
        nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        self.weight = nn.Parameter(w.chunk(G.tp, 1)[G.tp_rank].clone())
        self.bias = nn.Parameter(torch.zeros(fout))

    def forward(self, x):
        return Reduce.apply(F.linear(x, self.weight)) + self.bias


class WideProbe(nn.Module):
    def __init__(self, in_dim, hidden, n_blocks, n_cls, p=0.1):
        super().__init__()
        self.inp = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, 2048))
        self.blocks = nn.ModuleList()
        for _ in range(n_blocks):
            self.blocks.append(nn.ModuleDict({
                "norm": nn.LayerNorm(2048),
                "up": ColumnParallelLinear(2048, hidden),
                "down": RowParallelLinear(hidden, 2048),
            }))
        self.drop = nn.Dropout(p)
        self.head = ColumnParallelLinear(2048, n_cls, gather_output=True)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + self.drop(b["down"](F.gelu(b["up"](b["norm"](x)))))
        return self.head(x)


class Feats(Dataset):
    def __init__(self, feats, labels):
        self.x = np.load(feats, mmap_mode="r")
        self.y = np.load(labels)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.float32)), int(self.y[i])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-feats", required=True)
    ap.add_argument("--train-labels", required=True)
    ap.add_argument("--val-feats", required=True)
    ap.add_argument("--val-labels", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=65536)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1024, help="per data-parallel replica")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/wide_probe")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    make_groups(args.tp)
    torch.manual_seed(args.seed)
    # dropout masks on the replicated activations must agree between TP peers;
    # DP replicas get their own stream
    torch.cuda.manual_seed(args.seed + G.dp_rank)

    train_set = Feats(args.train_feats, args.train_labels)
    val_set = Feats(args.val_feats, args.val_labels)
    in_dim = train_set.x.shape[1]

    model = WideProbe(in_dim, args.hidden, args.blocks, args.classes).cuda()
    ddp = DDP(model, device_ids=[local_rank], process_group=G.dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=G.dp, rank=G.dp_rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch, sampler=val_sampler, num_workers=2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.05)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        run = torch.zeros(2, device="cuda")
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device="cuda")])

        ddp.eval()
        hits = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_loader:
                pred = ddp(x.cuda(non_blocking=True)).argmax(-1)
                hits += torch.stack([(pred == y.cuda()).sum().float(), torch.tensor(float(len(y)), device="cuda")])
        dist.all_reduce(run, group=G.dp_group)
        dist.all_reduce(hits, group=G.dp_group)
        acc = (hits[0] / hits[1]).item()
        if dist.get_rank() == 0:
            print(f"epoch {epoch} train_loss {(run[0] / run[1]).item():.4f} val_top1 {100 * acc:.2f}", flush=True)
        if acc > best:
            best = acc
            if G.dp_rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(args.out, f"best_tp{G.tp_rank}.pt"))
        dist.barrier()

    if dist.get_rank() == 0:
        print(f"best val top1 {100 * best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
