"""2-D parallel training of a feed-forward char-level LM.

Ranks are laid out as a (dp, tp) grid: the MLP blocks are split Megatron-style
(column-parallel then row-parallel linear) across the tp ranks of a row, and
gradients are averaged across the dp ranks of a column by hand.

    torchrun --nproc_per_node=8 03_tp_dp_groups_mlp.py --tp 2 --text corpus.txt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--n-blocks", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=256, help="per dp rank")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="tp_dp_ckpt")
    return p.parse_args()


def init_groups(tp_size):
    world = dist.get_world_size()
    rank = dist.get_rank()
    assert world % tp_size == 0
    tp_group = dp_group = None
    # rows: consecutive ranks share a tensor-parallel group (same node)
    for i in range(world // tp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        if rank in ranks:
            tp_group = dist.new_group(ranks)
    # columns: ranks holding the same shard form a data-parallel group
    for j in range(tp_size):
        ranks = list(range(j, world, tp_size))
        if rank in ranks:
            dp_group = dist.new_group(ranks)
    return tp_group, dp_group


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ParallelMLP(nn.Module):
    """h -> GELU(h W1_shard) W2_shard, partial sums reduced over the tp group."""

    def __init__(self, d_model, d_ff, tp_group, tp_rank, tp_size, gen):
        super().__init__()
        self.group = tp_group
        shard = d_ff // tp_size
        w1 = torch.empty(d_ff, d_model)
        w2 = torch.empty(d_model, d_ff)
        nn.init.normal_(w1, std=0.02, generator=gen)
        nn.init.normal_(w2, std=0.02 / math.sqrt(2), generator=gen)
        self.w1 = nn.Parameter(w1[tp_rank * shard:(tp_rank + 1) * shard].clone())
        self.b1 = nn.Parameter(torch.zeros(shard))
        self.w2 = nn.Parameter(w2[:, tp_rank * shard:(tp_rank + 1) * shard].clone())
        self.b2 = nn.Parameter(torch.zeros(d_model))  # replicated
        self.ln = nn.LayerNorm(d_model)

    def forward(self, x):
        h = _CopyToTP.apply(self.ln(x), self.group)
        h = F.gelu(F.linear(h, self.w1, self.b1))
        out = _ReduceFromTP.apply(F.linear(h, self.w2), self.group)
        return x + out + self.b2


class CharMLPLM(nn.Module):
    def __init__(self, vocab, args, tp_group, tp_rank, tp_size):
        super().__init__()
        gen = torch.Generator().manual_seed(args.seed)  # same full weights on every rank
        self.emb = nn.Embedding(vocab, 64)
        nn.init.normal_(self.emb.weight, std=0.02, generator=gen)
        self.proj_in = nn.Linear(64 * args.context, args.d_model)
        with torch.no_grad():
            self.proj_in.weight.normal_(0, 0.02, generator=gen)
            self.proj_in.bias.zero_()
        self.blocks = nn.ModuleList(
            [ParallelMLP(args.d_model, args.d_ff, tp_group, tp_rank, tp_size, gen)
             for _ in range(args.n_blocks)])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, vocab)
        with torch.no_grad():
            self.head.weight.normal_(0, 0.02, generator=gen)
            self.head.bias.zero_()

    def forward(self, idx):
        x = self.emb(idx).flatten(1)
        x = self.proj_in(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class CharWindows(Dataset):
    def __init__(self, ids, context):
        self.ids = ids
        self.context = context

    def __len__(self):
        return len(self.ids) - self.context

    def __getitem__(self, i):
        return self.ids[i:i + self.context], self.ids[i + self.context]


@torch.no_grad()
def allreduce_grads(model, dp_group, dp_size):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp_size)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tp_group, dp_group = init_groups(args.tp)
    tp_rank, tp_size = rank % args.tp, args.tp
    dp_rank, dp_size = rank // args.tp, world // args.tp

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))  # deterministic vocab on every rank
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.95 * len(ids))
    train_ds = CharWindows(ids[:split], args.context)
    val_ds = CharWindows(ids[split:], args.context)

    # tp ranks of a row must see the same batch, so sample by dp rank
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=2, drop_last=True, pin_memory=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank,
                                     shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=512, sampler=val_sampler, num_workers=2)

    model = CharMLPLM(len(chars), args, tp_group, tp_rank, tp_size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if rank == 0:
        print(f"world={world} dp={dp_size} tp={tp_size} vocab={len(chars)} "
              f"train_windows={len(train_ds)}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(model, dp_group, dp_size)
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                tot[0] += F.cross_entropy(model(x), y, reduction="sum")
                tot[1] += y.numel()
        dist.all_reduce(tot, group=dp_group)
        val_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} bpc {val_loss / math.log(2):.3f}", flush=True)

        # one file per tp shard, written by the first dp replica
        if dp_rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "chars": chars,
                        "tp_rank": tp_rank, "tp_size": tp_size},
                       os.path.join(args.out, f"tp{tp_rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
