"""
Top-2 MoE LM with GShard-style einsum dispatch (grouped tokens, fixed expert capacity).
All experts live on every GPU; gradients are averaged by DDP.

    torchrun --nproc_per_node=8 05_einsum_moe_pretrain.py --data /datasets/c4_tok --run-name moe8x125m
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
from tqdm import tqdm


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-name", default="moe")
    p.add_argument("--save-root", default="/checkpoints")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32128)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux", type=float, default=0.01)
    p.add_argument("--micro-bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=1500)
    p.add_argument("--steps", type=int, default=40000)
    p.add_argument("--eval-every", type=int, default=1000)
    return p


class TokenFile(Dataset):
    def __init__(self, path, seq):
        self.path, self.seq = path, seq
        self.count = (os.path.getsize(path) // 2 - 1) // seq
        self.mm = None

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        w = torch.from_numpy(self.mm[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


def top2_assign(logits, capacity):
    """logits: [G, S, E] -> combine [G, S, E, C], dispatch mask, aux loss, dropped fraction."""
    G, S, E = logits.shape
    probs = logits.float().softmax(-1)
    idx1 = probs.argmax(-1)
    mask1 = F.one_hot(idx1, E)
    idx2 = probs.masked_fill(mask1.bool(), float("-inf")).argmax(-1)
    mask2 = F.one_hot(idx2, E)

    aux = E * (probs.mean(1) * mask1.float().mean(1)).sum(-1).mean()

    loc1 = mask1.cumsum(1) - 1
    loc2 = mask2.cumsum(1) - 1 + mask1.sum(1, keepdim=True)
    mask1 = mask1 * (loc1 < capacity)
    mask2 = mask2 * (loc2 < capacity)
    dropped = 1.0 - (mask1.sum() + mask2.sum()).float() / (2 * G * S)

    g1 = (probs * mask1).sum(-1)
    g2 = (probs * mask2).sum(-1)
    denom = (g1 + g2).clamp_min(torch.finfo(probs.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    pos1 = (loc1 * mask1).sum(-1)
    pos2 = (loc2 * mask2).sum(-1)
    combine = (g1[..., None, None] * mask1[..., None] * F.one_hot(pos1, capacity)[:, :, None, :]
               + g2[..., None, None] * mask2[..., None] * F.one_hot(pos2, capacity)[:, :, None, :])
    return combine, combine > 0, aux, dropped


class ExpertBank(nn.Module):
    def __init__(self, width, ffn, experts, capacity_factor):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, width, ffn) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, width) * 0.02)
        self.capacity_factor = capacity_factor
        self.experts = experts

    def forward(self, x):
        G, S, D = x.shape  # one group per sequence
        cap = int(math.ceil(2 * self.capacity_factor * S / self.experts))
        combine, dispatch, aux, dropped = top2_assign(self.router(x), cap)
        xin = torch.einsum("gsec,gsd->egcd", dispatch.to(x.dtype), x)
        h = F.gelu(torch.einsum("egcd,edf->egcf", xin, self.w_in))
        xout = torch.einsum("egcf,efd->egcd", h, self.w_out)
        y = torch.einsum("gsec,egcd->gsd", combine.to(xout.dtype), xout)
        return y.to(x.dtype), aux, dropped


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads = a.heads
        self.norm_a = nn.LayerNorm(a.width)
        self.norm_f = nn.LayerNorm(a.width)
        self.qkv = nn.Linear(a.width, 3 * a.width, bias=False)
        self.out = nn.Linear(a.width, a.width, bias=False)
        self.moe = ExpertBank(a.width, a.ffn, a.experts, a.capacity_factor)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm_a(x)).chunk(3, dim=-1)
        q, k, v = [t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v)]
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        y, aux, dropped = self.moe(self.norm_f(x))
        return x + y, aux, dropped


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.width)
        self.pos = nn.Embedding(a.seq, a.width)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.width)
        self.unemb = nn.Linear(a.width, a.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos.weight[: idx.size(1)]
        auxes, drops = [], []
        for layer in self.layers:
            x, aux, dropped = layer(x)
            auxes.append(aux)
            drops.append(dropped)
        logits = self.unemb(self.norm(x)).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        return loss, torch.stack(auxes).mean(), torch.stack(drops).mean()


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    save_dir = os.path.join(args.save_root, args.run_name)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    train = TokenFile(os.path.join(args.data, "train.bin"), args.seq)
    val = TokenFile(os.path.join(args.data, "validation.bin"), args.seq)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=17, drop_last=True)
    va_sampler = DistributedSampler(val, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train, args.micro_bs, sampler=tr_sampler, num_workers=4,
                           pin_memory=True, drop_last=True, persistent_workers=True)
    va_loader = DataLoader(val, args.micro_bs, sampler=va_sampler, num_workers=2, pin_memory=True)

    model = DDP(Model(args).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=args.warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps - args.warmup, eta_min=args.lr / 10)],
        milestones=[args.warmup])

    def evaluate():
        model.eval()
        nll, n_tok, drop_sum, n_b = 0.0, 0, 0.0, 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in va_loader:
                x, y = x.to(device), y.to(device)
                loss, _, dropped = model(x, y)
                nll += loss.item() * y.numel()
                n_tok += y.numel()
                drop_sum += dropped.item()
                n_b += 1
        model.train()
        return nll / n_tok, drop_sum / max(n_b, 1)

    step, epoch = 0, 0
    best_val = float("inf")
    bar = tqdm(total=args.steps, disable=rank != 0, dynamic_ncols=True)
    while step < args.steps:
        tr_sampler.set_epoch(epoch)
        for x, y in tr_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, aux, dropped = model(x, y)
            (loss + args.aux * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                m = torch.stack([loss.detach(), aux.detach(), dropped.detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                bar.set_postfix(loss=f"{m[0]:.3f}", aux=f"{m[1]:.3f}", drop=f"{m[2]:.3f}",
                                lr=f"{sched.get_last_lr()[0]:.1e}")
            bar.update(1)

            if step % args.eval_every == 0:
                val_loss, val_drop = evaluate()
                if rank == 0:
                    tqdm.write(f"step {step}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f} "
                               f"dropped {100 * val_drop:.2f}%")
                    ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step, "val_loss": val_loss}
                    torch.save(ckpt, os.path.join(save_dir, "last.pt"))
                    if val_loss < best_val:
                        best_val = val_loss
                        torch.save(ckpt, os.path.join(save_dir, "best.pt"))
            if step >= args.steps:
                break
        epoch += 1

    bar.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
