"""Pairwise reward-model training on a tensor-parallel transformer (TP x DP).

Each example is (chosen, rejected); loss = -log sigmoid(r_chosen - r_rejected).

    torchrun --nproc_per_node=8 13_tp_reward_model.py --tp 2 --pairs data/hh_pairs.pt --init ckpt/sft_tp2
"""
import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split

PAD_ID = 0


class TPState:
    group = dp_group = None
    rank = size = dp_rank = dp_size = 0

    @classmethod
    def init(cls, tp):
        world, r = dist.get_world_size(), dist.get_rank()
        cls.size, cls.rank, cls.dp_size, cls.dp_rank = tp, r % tp, world // tp, r // tp
        for i in range(cls.dp_size):
            ranks = [i * tp + k for k in range(tp)]
            g = dist.new_group(ranks)
            if r in ranks:
                cls.group = g
        for k in range(tp):
            ranks = [i * tp + k for i in range(cls.dp_size)]
            g = dist.new_group(ranks)
            if r in ranks:
                cls.dp_group = g


class _ToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=TPState.group)
        return g


class _FromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=TPState.group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Col(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.w = nn.Parameter(torch.empty(o // TPState.size, i).normal_(std=0.02))
        self.b = nn.Parameter(torch.zeros(o // TPState.size))

    def forward(self, x):
        return F.linear(_ToTP.apply(x), self.w, self.b)


class Row(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.w = nn.Parameter(torch.empty(o, i // TPState.size).normal_(std=0.02))
        self.b = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return _FromTP.apply(F.linear(x, self.w)) + self.b


class Layer(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh, self.hd = nh // TPState.size, d // nh
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = Col(d, 3 * d), Row(d, d)
        self.up, self.down = Col(d, 4 * d), Row(4 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, self.nh, 3 * self.hd).transpose(1, 2).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class RewardModel(nn.Module):
    def __init__(self, vocab, d, nh, nl, max_len):
        super().__init__()
        self.vp = vocab // TPState.size
        self.v0 = TPState.rank * self.vp
        self.tok = nn.Parameter(torch.empty(self.vp, d).normal_(std=0.02))
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Layer(d, nh) for _ in range(nl))
        self.ln_f = nn.LayerNorm(d)
        self.value_head = nn.Linear(d, 1)

    def forward(self, ids):
        rel = ids - self.v0
        out = (rel < 0) | (rel >= self.vp)
        x = F.embedding(rel.masked_fill(out, 0), self.tok).masked_fill(out.unsqueeze(-1), 0.0)
        x = _FromTP.apply(x) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        last = (ids != PAD_ID).sum(1) - 1  # right padded
        return self.value_head(x[torch.arange(ids.size(0), device=ids.device), last]).squeeze(-1)


class Pairs(Dataset):
    def __init__(self, path):
        self.rows = torch.load(path, map_location="cpu")  # list of dicts with chosen / rejected id tensors

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]["chosen"], self.rows[i]["rejected"]


def collate(batch, max_len):
    seqs = [c[:max_len] for c, _ in batch] + [r[:max_len] for _, r in batch]
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--pairs-per-step", type=int, default=8, help="per data-parallel replica")
    ap.add_argument("--lr", type=float, default=9e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", default="ckpt/rm_tp2")
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    TPState.init(args.tp)
    torch.manual_seed(0)

    rm = RewardModel(args.vocab, args.d, args.heads, args.layers, args.max_len)
    sd = torch.load(os.path.join(args.init, f"tp{TPState.rank}.pt"), map_location="cpu")
    missing, _ = rm.load_state_dict(sd, strict=False)  # value head is new
    assert all(k.startswith("value_head") for k in missing), missing
    rm.cuda()
    model = DDP(rm, device_ids=[torch.cuda.current_device()], process_group=TPState.dp_group)
    opt = torch.optim.AdamW(rm.parameters(), lr=args.lr, weight_decay=0.0)

    full = Pairs(args.pairs)
    n_eval = min(2000, len(full) // 20)
    train_set, eval_set = random_split(full, [len(full) - n_eval, n_eval], generator=torch.Generator().manual_seed(0))
    # identical generator seed on every rank so that tensor-parallel peers read the same pairs
    g = torch.Generator().manual_seed(1234)
    train_dl = DataLoader(train_set, batch_size=args.pairs_per_step, shuffle=True, generator=g,
                          collate_fn=partial(collate, max_len=args.max_len), num_workers=2, drop_last=True)
    eval_idx = list(range(TPState.dp_rank, len(eval_set), TPState.dp_size))
    eval_dl = DataLoader(torch.utils.data.Subset(eval_set, eval_idx), batch_size=args.pairs_per_step,
                         collate_fn=partial(collate, max_len=args.max_len))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for ids in train_dl:
            ids = ids.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                r = model(ids).float()
            rc, rr = r.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                st = torch.stack([loss.detach(), (rc > rr).float().mean()])
                dist.all_reduce(st, op=dist.ReduceOp.AVG, group=TPState.dp_group)
                if dist.get_rank() == 0:
                    print(f"step {step}/{total} loss {st[0].item():.4f} acc {st[1].item():.3f}", flush=True)

        model.eval()
        acc = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for ids in eval_dl:
                rc, rr = model(ids.cuda()).float().chunk(2)
                acc += torch.stack([(rc > rr).sum().float(), torch.tensor(float(len(rc)), device="cuda")])
        dist.all_reduce(acc, group=TPState.dp_group)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} eval pairwise acc {(acc[0] / acc[1]).item():.4f}", flush=True)

        if TPState.dp_rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(rm.state_dict(), os.path.join(args.out, f"tp{TPState.rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
