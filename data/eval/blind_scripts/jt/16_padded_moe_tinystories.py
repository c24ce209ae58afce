"""
Top-2 MoE LM (capacity-padded batched experts) with expert-utilisation monitoring in TensorBoard.

    torchrun --nproc_per_node=4 16_padded_moe_tinystories.py --data ./data/tinystories_tok --logdir runs/ts_moe
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class TokDataset(Dataset):
    def __init__(self, path, T):
        self.path, self.T = path, T
        self.N = (os.path.getsize(path) // 2 - 1) // T
        self.data = None

    def __len__(self):
        return self.N

    def __getitem__(self, i):
        if self.data is None:
            self.data = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = torch.from_numpy(self.data[i * self.T:(i + 1) * self.T + 1].astype(np.int64))
        return s[:-1], s[1:]


class ExpertLoadTracker:
    """Accumulates how many tokens each expert of each MoE layer received between log steps."""

    def __init__(self, n_layers, n_experts, device="cuda:0"):
        self.counts = torch.zeros(n_layers, n_experts, device=device)
        self.dropped = torch.zeros(n_layers, device=device)

    def update(self, layer_counts, layer_dropped):
        self.counts += layer_counts
        self.dropped += layer_dropped

    def reduce_and_reset(self):
        dist.all_reduce(self.counts)
        dist.all_reduce(self.dropped)
        frac = self.counts / self.counts.sum(-1, keepdim=True).clamp_min(1)
        drop = self.dropped / self.counts.sum(-1).add(self.dropped).clamp_min(1)
        self.counts.zero_()
        self.dropped.zero_()
        return frac.cpu(), drop.cpu()


class PaddedMoE(nn.Module):
    def __init__(self, d, n_experts, capacity_factor):
        super().__init__()
        self.E, self.cf = n_experts, capacity_factor
        self.router = nn.Linear(d, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, d, 4 * d) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(n_experts, 4 * d, d) / math.sqrt(4 * d))
        self.load = None
        self.n_dropped = None
        self.aux = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        n = x.size(0)
        probs = self.router(x).float().softmax(-1)
        gw, ge = probs.topk(2, -1)
        gw = gw / gw.sum(-1, keepdim=True)
        self.aux = self.E * (F.one_hot(ge, self.E).float().mean((0, 1)) * probs.mean(0)).sum()
        cap = math.ceil(self.cf * 2 * n / self.E)
        e, w = ge.t().reshape(-1), gw.t().reshape(-1)
        t = torch.arange(n, device=x.device).repeat(2)
        oh = F.one_hot(e, self.E)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < cap
        self.load = torch.bincount(e[keep], minlength=self.E).float().detach()
        self.n_dropped = (~keep).sum().float().detach()
        slot = e[keep] * cap + pos[keep]
        buf = x.new_zeros(self.E * cap, D)
        buf[slot] = x[t[keep]]
        h = torch.bmm(F.silu(torch.bmm(buf.view(self.E, cap, D), self.w1)), self.w2).view(-1, D)
        y = torch.zeros(n, D, device=x.device, dtype=h.dtype)
        y.index_add_(0, t[keep], h[slot] * w[keep, None].to(h.dtype))
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, d, nh, E, cf):
        super().__init__()
        self.nh = nh
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.moe = PaddedMoE(d, E, cf)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.nh, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.n2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab, T, d, nh, L, E, cf):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(T, d))
        self.blocks = nn.ModuleList(Block(d, nh, E, cf) for _ in range(L))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        aux = torch.stack([b.moe.aux for b in self.blocks]).mean()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), aux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--logdir", default="runs/moe")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--aux_coef", type=float, default=0.01)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--log_every", type=int, default=50)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    assert args.global_batch % world == 0
    per_gpu = args.global_batch // world

    train = TokDataset(os.path.join(args.data, "train.bin"), args.T)
    val = TokDataset(os.path.join(args.data, "val.bin"), args.T)
    tsamp = DistributedSampler(train, shuffle=True, drop_last=True)
    vsamp = DistributedSampler(val, shuffle=False, drop_last=True)
    tl = DataLoader(train, per_gpu, sampler=tsamp, num_workers=4, pin_memory=True, drop_last=True)
    vl = DataLoader(val, per_gpu, sampler=vsamp, num_workers=2, pin_memory=True)

    model = TinyMoELM(args.vocab, args.T, args.d, args.heads, args.layers, args.experts, args.cf).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    total = args.epochs * len(tl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
    tracker = ExpertLoadTracker(args.layers, args.experts)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        tsamp.set_epoch(epoch)
        t0 = time.time()
        for x, y in tl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, aux = model(x, y)
            opt.zero_grad(set_to_none=True)
            (loss + args.aux_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            blocks = model.module.blocks
            tracker.update(torch.stack([b.moe.load for b in blocks]), torch.stack([b.moe.n_dropped for b in blocks]))
            if step % args.log_every == 0:
                frac, drop = tracker.reduce_and_reset()
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} aux {aux.item():.3f} "
                          f"max-load {frac.max().item():.3f} drop {drop.mean().item():.2%} "
                          f"{(time.time() - t0) / args.log_every:.3f}s/it", flush=True)
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/dropped", drop.mean().item(), step)
                    for i in range(args.layers):
                        writer.add_histogram(f"expert_load/layer{i}", frac[i], step)
                t0 = time.time()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in vl:
                vloss, _ = model(x.to(device), y.to(device))
                acc += torch.stack([vloss.float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        model.train()
        if rank == 0:
            val_loss = (acc[0] / acc[1]).item()
            print(f"epoch {epoch} val loss {val_loss:.4f}", flush=True)
            writer.add_scalar("val/loss", val_loss, step)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.logdir, f"epoch{epoch}.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
