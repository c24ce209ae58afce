"""GPT pretraining with Megatron-style tensor parallelism + data parallelism.

Launch (one node, 8 GPUs, TP=4 x DP=2):
    torchrun --nproc_per_node=8 01_tp_gpt_pretrain.py --tp-size 4 --data data/train.bin
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

_TP_GROUP = None
_DP_GROUP = None


def init_model_parallel(tp_size):
    global _TP_GROUP, _DP_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % tp_size == 0, f"world size {world} not divisible by tp {tp_size}"
    dp_size = world // tp_size
    # every rank has to take part in every new_group call
    for i in range(dp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP = group
    for j in range(tp_size):
        ranks = list(range(j, world, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP = group


def tp_rank():
    return dist.get_rank(_TP_GROUP)


def tp_world():
    return dist.get_world_size(_TP_GROUP)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_TP_GROUP)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=_TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _shard_init(full_shape, dim, std):
    full = torch.empty(full_shape)
    nn.init.normal_(full, mean=0.0, std=std)
    return nn.Parameter(full.chunk(tp_world(), dim=dim)[tp_rank()].contiguous())


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_f, out_f, std=0.02):
        super().__init__()
        self.weight = _shard_init((out_f, in_f), 0, std)
        self.bias = nn.Parameter(torch.zeros(out_f // tp_world()))
        self.weight.tensor_parallel = self.bias.tensor_parallel = True

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_f, out_f, std=0.02):
        super().__init__()
        self.weight = _shard_init((out_f, in_f), 1, std)
        self.weight.tensor_parallel = True
        self.bias = nn.Parameter(torch.zeros(out_f))

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight)) + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        per = vocab // tp_world()
        self.vocab_start = tp_rank() * per
        self.vocab_end = self.vocab_start + per
        self.weight = _shard_init((vocab, dim), 0, 0.02)
        self.weight.tensor_parallel = True

    def forward(self, ids):
        mask = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = ids - self.vocab_start
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end):
        logits = logits.float()
        lmax = logits.max(dim=-1)[0]
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=_TP_GROUP)
        logits = logits - lmax.unsqueeze(-1)
        part = logits.size(-1)
        tmask = (target < vocab_start) | (target >= vocab_end)
        mtarget = target - vocab_start
        mtarget[tmask] = 0
        l2d = logits.view(-1, part)
        t1d = mtarget.view(-1)
        rows = torch.arange(l2d.size(0), device=l2d.device)
        picked = l2d[rows, t1d].clone().view_as(target)
        picked[tmask] = 0.0
        dist.all_reduce(picked, group=_TP_GROUP)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=_TP_GROUP)
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, tmask, t1d)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        softmax, tmask, t1d = ctx.saved_tensors
        g2d = softmax.view(-1, softmax.size(-1))
        rows = torch.arange(g2d.size(0), device=g2d.device)
        g2d[rows, t1d] -= 1.0 - tmask.view(-1).float()
        softmax.mul_(grad_out.unsqueeze(-1))
        return softmax, None, None, None


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.local_heads = n_head // tp_world()
        self.hd = d // n_head
        self.qkv = ColumnParallelLinear(d, 3 * d)
        self.proj = RowParallelLinear(d, d)
        self.fc = ColumnParallelLinear(d, 4 * d)
        self.out = RowParallelLinear(4 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, self.local_heads, 3 * self.hd).split(self.hd, -1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, n_head, n_layer, seq_len):
        super().__init__()
        self.wte = VocabParallelEmbedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids, targets):
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(_CopyToTP.apply(self.ln_f(x)), self.wte.weight)
        loss = _VocabParallelCE.apply(logits, targets, self.wte.vocab_start, self.wte.vocab_end)
        return loss.mean()


class TokenBlocks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        buf = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return buf[:-1], buf[1:]


@torch.no_grad()
def clip_grads(params, max_norm):
    sq = torch.zeros(1, device="cuda")
    for p in params:
        if p.grad is None:
            continue
        # replicated params are counted once (on tp rank 0)
        if getattr(p, "tensor_parallel", False) or tp_rank() == 0:
            sq += p.grad.float().pow(2).sum()
    dist.all_reduce(sq, group=_TP_GROUP)
    norm = sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/train.bin")
    ap.add_argument("--val-data", default="data/val.bin")
    ap.add_argument("--tp-size", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--save-dir", default="checkpoints/gpt_tp")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    init_model_parallel(args.tp_size)
    rank = dist.get_rank()
    dp_rank, dp_size = dist.get_rank(_DP_GROUP), dist.get_world_size(_DP_GROUP)
    torch.manual_seed(args.seed)

    model = GPT(args.vocab, args.d_model, args.n_head, args.n_layer, args.seq_len).cuda()
    params = list(model.parameters())
    model = DDP(model, device_ids=[local_rank], process_group=_DP_GROUP)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup)
        * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps)))

    micro = args.global_batch // dp_size
    train_ds, val_ds = TokenBlocks(args.data, args.seq_len), TokenBlocks(args.val_data, args.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=micro, sampler=val_sampler, num_workers=2, drop_last=True)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = clip_grads(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, group=_DP_GROUP)
                if rank == 0:
                    dt = (time.time() - t0) / 20
                    t0 = time.time()
                    print(f"step {step} loss {l.item() / dp_size:.4f} gnorm {gnorm:.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {dt * 1000:.0f}ms/it", flush=True)
            if step % args.eval_every == 0:
                model.eval()
                tot = torch.zeros(2, device="cuda")
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for i, (vx, vy) in enumerate(val_loader):
                        if i == 50:
                            break
                        tot[0] += model(vx.cuda(), vy.cuda()).float()
                        tot[1] += 1
                dist.all_reduce(tot, group=_DP_GROUP)
                if rank == 0:
                    print(f"step {step} val_loss {(tot[0] / tot[1]).item():.4f}", flush=True)
                if dp_rank == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.save_dir, f"step{step:07d}_tp{tp_rank():02d}.pt"))
                dist.barrier()
                model.train()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
