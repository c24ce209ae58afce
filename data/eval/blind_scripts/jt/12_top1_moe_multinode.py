"""
Top-1 MoE LM trained from a directory of pre-tokenized shards (shard_00000.bin ...).
Each rank streams random windows from its own subset of shards; a few shards are held out
for validation.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        12_top1_moe_multinode.py --shard_dir /lustre/corpus/tok_shards --save_dir /lustre/exp/moe_top1
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RandomWindowStream(IterableDataset):
    """Endless stream of random (x, y) windows drawn from a list of uint16 shards."""

    def __init__(self, files, ctx, seed):
        self.files, self.ctx, self.seed = files, ctx, seed

    def __iter__(self):
        wi = get_worker_info()
        wid = wi.id if wi is not None else 0
        rng = np.random.default_rng(self.seed * 1000 + wid)
        maps = [np.memmap(f, dtype=np.uint16, mode="r") for f in self.files]
        sizes = np.array([len(m) for m in maps], dtype=np.float64)
        probs = sizes / sizes.sum()
        while True:
            m = maps[rng.choice(len(maps), p=probs)]
            s = int(rng.integers(0, len(m) - self.ctx - 1))
            w = torch.from_numpy(m[s:s + self.ctx + 1].astype(np.int64))
            yield w[:-1], w[1:]


class Top1MoE(nn.Module):
    def __init__(self, d, n_exp, cf):
        super().__init__()
        self.n_exp, self.cf = n_exp, cf
        self.gate = nn.Linear(d, n_exp, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_exp, d, 4 * d) * 0.02)
        self.w2 = nn.Parameter(torch.randn(n_exp, 4 * d, d) * 0.02)

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        n = x.size(0)
        probs = self.gate(x).float().softmax(-1)
        p, e = probs.max(-1)
        oh = F.one_hot(e, self.n_exp)
        aux = self.n_exp * (oh.float().mean(0) * probs.mean(0)).sum()
        cap = int(self.cf * n / self.n_exp)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = (pos < cap).nonzero(as_tuple=True)[0]
        slot = e[keep] * cap + pos[keep]
        buf = x.new_zeros(self.n_exp * cap, D)
        buf[slot] = x[keep]
        buf = buf.view(self.n_exp, cap, D)
        out = torch.bmm(F.gelu(torch.bmm(buf, self.w1)), self.w2).view(-1, D)
        y = torch.zeros(n, D, device=x.device, dtype=out.dtype)
        y[keep] = out[slot] * p[keep, None].to(out.dtype)
        dropped = 1.0 - keep.numel() / n
        return y.to(x.dtype).view(B, T, D), aux, dropped


class Block(nn.Module):
    def __init__(self, d, nh, n_exp, cf, drop):
        super().__init__()
        self.nh, self.drop = nh, drop
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.moe = Top1MoE(d, n_exp, cf)
        self.dropout = nn.Dropout(drop)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.nh, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.drop if self.training else 0.0)
        x = x + self.dropout(self.out(a.transpose(1, 2).reshape(B, T, D)))
        y, aux, dropped = self.moe(self.ln2(x))
        return x + self.dropout(y), aux, dropped


class LM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.ctx, a.d)
        self.blocks = nn.ModuleList(Block(a.d, a.heads, a.experts, a.cf, a.dropout) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        auxs, drops = [], []
        for b in self.blocks:
            x, aux, d = b(x)
            auxs.append(aux)
            drops.append(d)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), torch.stack(auxs).mean(), sum(drops) / len(drops)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard_dir", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--val_shards", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--aux_coef", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--eval_steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)  # different dropout masks on each rank

    files = sorted(glob.glob(os.path.join(args.shard_dir, "shard_*.bin")))
    random.shuffle(files)
    val_files, train_files = files[:args.val_shards], files[args.val_shards:]
    my_train = train_files[rank::world]
    if rank == 0:
        print(f"{len(files)} shards: {len(train_files)} train / {len(val_files)} val, {len(my_train)} per rank")

    train_dl = DataLoader(RandomWindowStream(my_train, args.ctx, args.seed + rank), batch_size=args.batch,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(RandomWindowStream(val_files, args.ctx, 10_000 + rank), batch_size=args.batch,
                        num_workers=1, pin_memory=True)

    model = DDP(LM(args).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = torch.zeros(2, device=device)
        it = iter(val_dl)
        for _ in range(args.eval_steps):
            x, y = next(it)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _, d = model(x.to(device), y.to(device))
            tot += torch.stack([loss, torch.tensor(d, device=device)])
        dist.all_reduce(tot, op=dist.ReduceOp.AVG)
        model.train()
        return (tot / args.eval_steps).tolist()

    t0 = time.time()
    batches = iter(train_dl)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, aux, dropped = model(x, y)
        (loss + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        if step % 25 == 0:
            m = torch.tensor([loss.item(), aux.item(), dropped], device=device)
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {m[0]:.4f} aux {m[1]:.4f} dropped {m[2]:.2%} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 25:.3f}s/step", flush=True)
            t0 = time.time()

        if step % args.eval_every == 0:
            vl, vd = evaluate()
            if rank == 0:
                print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.2f} dropped {vd:.2%}", flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                            "val_files": val_files, "args": vars(args)},
                           os.path.join(args.save_dir, f"ckpt_{step:06d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
