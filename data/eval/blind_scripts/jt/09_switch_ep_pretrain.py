# Switch Transformer (top-1) LM with expert parallelism across all ranks.
# Dense gradients are all-reduced by hand; expert gradients stay on the owning rank.
#
#   torchrun --nproc_per_node=8 09_switch_ep_pretrain.py --data /scratch/tok/pile --save /scratch/ckpt/switch_ep
#   (resume: add --resume /scratch/ckpt/switch_ep/step_020000.pt)
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Seqs(Dataset):
    def __init__(self, path, n_ctx):
        self.path, self.n_ctx = path, n_ctx
        self.size = (os.path.getsize(path) // 2 - 1) // n_ctx
        self.buf = None

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if self.buf is None:
            self.buf = np.memmap(self.path, dtype=np.uint16, mode="r")
        t = torch.from_numpy(self.buf[i * self.n_ctx:(i + 1) * self.n_ctx + 1].astype(np.int64))
        return t[:-1], t[1:]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp):
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = torch.empty_like(grad_out)
        dist.all_to_all_single(grad_in, grad_out.contiguous())
        return grad_in


class SwitchEP(nn.Module):
    def __init__(self, d, d_ff, n_experts, capacity_factor, jitter):
        super().__init__()
        self.world = dist.get_world_size()
        self.n_experts = n_experts
        self.n_local = n_experts // self.world
        self.capacity_factor = capacity_factor
        self.jitter = jitter
        self.router = nn.Linear(d, n_experts, bias=False)
        self.fc1 = nn.Parameter(torch.randn(self.n_local, d, d_ff) * d ** -0.5)
        self.fc2 = nn.Parameter(torch.randn(self.n_local, d_ff, d) * d_ff ** -0.5)
        self.fc1.is_expert = True
        self.fc2.is_expert = True
        self.balance_loss = None
        self.drop_rate = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        n = x.size(0)
        r_in = x
        if self.training and self.jitter > 0:
            r_in = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
        probs = self.router(r_in).float().softmax(-1)
        p_max, e_idx = probs.max(-1)

        onehot = F.one_hot(e_idx, self.n_experts)
        self.balance_loss = self.n_experts * (onehot.float().mean(0) * probs.mean(0)).sum()

        cap = int(self.capacity_factor * n / self.n_experts)
        pos = (onehot.cumsum(0) * onehot).sum(-1) - 1
        keep = pos < cap
        self.drop_rate = 1.0 - keep.float().mean()
        tok = torch.nonzero(keep, as_tuple=True)[0]
        slot = e_idx[tok] * cap + pos[tok]

        dispatch = x.new_zeros(self.n_experts * cap, D)
        dispatch[slot] = x[tok]
        h = _Exchange.apply(dispatch).view(self.world, self.n_local, cap, D)
        h = h.transpose(0, 1).reshape(self.n_local, self.world * cap, D)
        h = torch.bmm(F.relu(torch.bmm(h, self.fc1.to(h.dtype))), self.fc2.to(h.dtype))
        h = h.view(self.n_local, self.world, cap, D).transpose(0, 1).reshape(self.n_experts * cap, D)
        h = _Exchange.apply(h)

        y = torch.zeros(n, D, device=x.device, dtype=h.dtype)
        y[tok] = h[slot] * p_max[tok, None].to(h.dtype)
        return y.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, a, sparse):
        super().__init__()
        self.heads = a.heads
        self.norm1 = nn.LayerNorm(a.d)
        self.norm2 = nn.LayerNorm(a.d)
        self.qkv = nn.Linear(a.d, 3 * a.d)
        self.o = nn.Linear(a.d, a.d)
        if sparse:
            self.ff = SwitchEP(a.d, a.d_ff, a.experts, a.capacity_factor, a.jitter)
        else:
            self.ff = nn.Sequential(nn.Linear(a.d, a.d_ff), nn.ReLU(), nn.Linear(a.d_ff, a.d))

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.norm2(x))


class SwitchLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.n_ctx, a.d)
        self.blocks = nn.ModuleList(Block(a, sparse=(i % 2 == 1)) for i in range(a.layers))
        self.norm = nn.LayerNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
        sw = [b.ff for b in self.blocks if isinstance(b.ff, SwitchEP)]
        bal = torch.stack([m.balance_loss for m in sw]).mean()
        drop = torch.stack([m.drop_rate for m in sw]).mean().detach()
        return ce, bal, drop


def save_checkpoint(path, model, opt, step):
    # experts are sharded, so every rank contributes its own part of the model
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rank": dist.get_rank()}
    torch.save(state, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save", default="ckpt/switch_ep")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--n_ctx", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--d_ff", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--jitter", type=float, default=0.01)
    ap.add_argument("--balance_coef", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--save_every", type=int, default=5000)
    a = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    assert a.experts % world == 0

    torch.manual_seed(rank)  # expert init differs per rank; dense weights are broadcast below
    model = SwitchLM(a).to(dev)
    dense = [p for p in model.parameters() if not getattr(p, "is_expert", False)]
    expert = [p for p in model.parameters() if getattr(p, "is_expert", False)]
    for p in dense:
        dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / a.warmup, math.sqrt(a.warmup / (s + 1))))

    step = 0
    if a.resume:
        st = torch.load(a.resume, map_location=dev)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step = st["step"]
        for _ in range(step):
            sched.step()

    ds = Seqs(os.path.join(a.data, "train.bin"), a.n_ctx)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(a.save, exist_ok=True)

    epoch = step // len(loader)
    t_last = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ce, bal, drop = model(x, y)
                loss = ce + a.balance_coef * bal
            opt.zero_grad(set_to_none=True)
            loss.backward()

            handles = [dist.all_reduce(p.grad, async_op=True) for p in dense]
            for h in handles:
                h.wait()
            for p in dense + expert:
                p.grad.div_(world)
            sq = torch.stack([p.grad.float().pow(2).sum() for p in expert]).sum()
            dist.all_reduce(sq)
            norm = (sq + torch.stack([p.grad.float().pow(2).sum() for p in dense]).sum()).sqrt()
            if norm > 1.0:
                for p in dense + expert:
                    p.grad.mul_(1.0 / norm)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                m = torch.stack([ce.detach(), bal.detach(), drop])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step:>7} ce {m[0]:.4f} balance {m[1]:.4f} dropped {m[2]:.2%} "
                          f"gnorm {norm:.3f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t_last) / 100:.3f}s/step", flush=True)
                t_last = time.time()

            if step % a.save_every == 0:
                save_checkpoint(os.path.join(a.save, f"step_{step:06d}.pt"), model, opt, step)
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
