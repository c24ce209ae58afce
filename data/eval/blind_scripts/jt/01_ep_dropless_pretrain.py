"""Expert-parallel MoE LM pretraining with variable-size all_to_all dispatch.

Each rank owns num_experts / world_size experts. Tokens are routed top-k,
overflow beyond the per-expert capacity is dropped locally, and the remaining
tokens are exchanged with all_to_all_single using per-rank split sizes.

    torchrun --nproc_per_node=8 01_ep_dropless_pretrain.py --data_dir /data/owt
"""
import argparse
import contextlib
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="checkpoints/ep_moe")
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--n_heads", type=int, default=12)
    p.add_argument("--n_layers", type=int, default=12)
    p.add_argument("--num_experts", type=int, default=16)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--capacity_factor", type=float, default=1.25)
    p.add_argument("--aux_coef", type=float, default=0.01)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--global_batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=50)
    p.add_argument("--log_every", type=int, default=20)
    return p.parse_args()


class BinTokens(Dataset):
    def __init__(self, path, block_size):
        self.path, self.block_size = path, block_size
        self.n = (os.path.getsize(path) // 2 - 1) // block_size
        self.data = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.data is None:
            self.data = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = i * self.block_size
        x = torch.from_numpy(self.data[s:s + self.block_size + 1].astype(np.int64))
        return x[:-1], x[1:]


class AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        out = x.new_empty((sum(output_splits), x.size(1)))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        g = AllToAllV.apply(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group)
        return g, None, None, None


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, d, num_experts, top_k, capacity_factor, group=None):
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group)
        assert num_experts % self.ep == 0, "num_experts must divide world size"
        self.E, self.k, self.cf = num_experts, top_k, capacity_factor
        self.n_local = num_experts // self.ep
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, 4 * d) for _ in range(self.n_local)])
        self.aux_loss = torch.zeros(())
        self.drop_frac = torch.zeros(())

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        N = x.size(0)
        logits = self.gate(x).float()
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)

        me = probs.mean(0)
        ce = F.one_hot(idx, self.E).sum(1).float().mean(0) / self.k
        self.aux_loss = self.E * (me * ce).sum()

        # first choices get slots before second choices
        flat_e = idx.t().reshape(-1)
        flat_w = w.t().reshape(-1)
        flat_t = torch.arange(N, device=x.device).repeat(self.k)
        cap = math.ceil(self.cf * N * self.k / self.E)
        oh = F.one_hot(flat_e, self.E)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < cap
        self.drop_frac = 1.0 - keep.float().mean()

        flat_e, flat_w, flat_t = flat_e[keep], flat_w[keep], flat_t[keep]
        order = torch.argsort(flat_e, stable=True)
        flat_e, flat_w, flat_t = flat_e[order], flat_w[order], flat_t[order]

        counts = torch.bincount(flat_e, minlength=self.E).cpu()
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        input_splits = counts.view(self.ep, self.n_local).sum(1).tolist()
        output_splits = recv_counts.view(self.ep, self.n_local).sum(1).tolist()

        recv = AllToAllV.apply(x[flat_t], output_splits, input_splits, self.group)

        # recv is laid out [src rank][local expert]; regroup per expert
        sizes = recv_counts.tolist()
        chunks = list(recv.split(sizes))
        outs = [None] * len(chunks)
        for e, expert in enumerate(self.experts):
            ids = [s * self.n_local + e for s in range(self.ep)]
            y = expert(torch.cat([chunks[i] for i in ids]))
            for i, piece in zip(ids, y.split([sizes[i] for i in ids])):
                outs[i] = piece
        back = AllToAllV.apply(torch.cat(outs), input_splits, output_splits, self.group)

        out = torch.zeros(N, D, device=x.device, dtype=torch.float32)
        out.index_add_(0, flat_t, back.float() * flat_w.unsqueeze(-1))
        return out.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, args, use_moe):
        super().__init__()
        d = args.d_model
        self.n_heads = args.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        if use_moe:
            self.ffn = MoE(d, args.num_experts, args.top_k, args.capacity_factor)
        else:
            self.ffn = Expert(d, 4 * d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.ffn(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok = nn.Embedding(args.vocab_size, args.d_model)
        self.pos = nn.Embedding(args.block_size, args.d_model)
        self.blocks = nn.ModuleList([Block(args, use_moe=(i % 2 == 1)) for i in range(args.n_layers)])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        moe = [m for m in self.modules() if isinstance(m, MoE)]
        aux = sum(m.aux_loss for m in moe) / len(moe)
        drop = sum(m.drop_frac.detach() for m in moe) / len(moe)
        return loss, aux, drop


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    r = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, loader, n_batches, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= n_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _, _ = model(x, y)
        tot += torch.stack([loss.detach(), torch.ones((), device=device)])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)  # experts differ per rank; dense weights come from rank 0 via DDP

    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch

    model = MoEGPT(args).to(device)
    expert_names = [n for n, _ in model.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DDP(model, device_ids=[local_rank])
    expert_params = [p for n, p in model.named_parameters() if ".experts." in n]
    dense_params = [p for n, p in model.named_parameters() if ".experts." not in n]

    opt = torch.optim.AdamW([
        {"params": [p for p in dense_params if p.dim() >= 2] + expert_params, "weight_decay": 0.1},
        {"params": [p for p in dense_params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=args.lr, betas=(0.9, 0.95), fused=True)

    train_ds = BinTokens(os.path.join(args.data_dir, "train.bin"), args.block_size)
    val_ds = BinTokens(os.path.join(args.data_dir, "val.bin"), args.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler,
                        num_workers=2, pin_memory=True, drop_last=True)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world} accum={accum} experts/rank={args.num_experts // world}")

    step, epoch = 0, 0
    train_sampler.set_epoch(epoch)
    it = iter(train_dl)
    t0 = time.time()
    while step < args.max_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        stats = torch.zeros(3, device=device)
        for micro in range(accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                train_sampler.set_epoch(epoch)
                it = iter(train_dl)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = micro == accum - 1
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, aux, drop = ddp(x, y)
                    total = (loss + args.aux_coef * aux) / accum
                total.backward()
            stats += torch.stack([loss.detach(), aux.detach(), drop]) / accum

        for p in expert_params:
            if p.grad is not None:
                p.grad.div_(world)
        dense_sq = sum(p.grad.float().pow(2).sum() for p in dense_params if p.grad is not None)
        exp_sq = sum(p.grad.float().pow(2).sum() for p in expert_params if p.grad is not None)
        dist.all_reduce(exp_sq)
        gnorm = torch.sqrt(dense_sq + exp_sq)
        clip = torch.clamp(1.0 / (gnorm + 1e-6), max=1.0)
        for p in dense_params + expert_params:
            if p.grad is not None:
                p.grad.mul_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % args.log_every == 0:
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                dt = (time.time() - t0) / args.log_every
                t0 = time.time()
                print(f"step {step} loss {stats[0]:.4f} aux {stats[1]:.4f} dropped {stats[2]:.3%} "
                      f"gnorm {gnorm.item():.3f} lr {lr_at(step, args):.2e} {dt * 1000:.0f}ms/it")

        if step % args.eval_every == 0 or step == args.max_steps:
            val = evaluate(ddp, val_dl, args.eval_batches, device)
            dense_state = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
            expert_state = {k: v for k, v in model.state_dict().items() if ".experts." in k}
            if rank == 0:
                print(f"step {step} val_loss {val:.4f} ppl {math.exp(val):.2f}")
                torch.save({"model": dense_state, "step": step, "world_size": world, "args": vars(args)},
                           os.path.join(args.out_dir, "dense.pt"))
            torch.save({"experts": expert_state, "optim": opt.state_dict(), "step": step},
                       os.path.join(args.out_dir, f"experts_rank{rank:03d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
