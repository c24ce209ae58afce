"""Small Mixtral-style MoE decoder (SwiGLU experts, top-2, capacity) trained with DDP.

Besides the loss we track per-layer expert load, dropped-token rate and router
entropy over each logging window and write them to TensorBoard.

    torchrun --nproc_per_node=8 06_mixtral_style_small.py --data-dir /data/fineweb_edu_10B --run-name mix8x150m
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


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--run-name", default="moe")
    ap.add_argument("--log-root", default="runs")
    ap.add_argument("--ckpt-root", default="checkpoints")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--n-exp", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--cap-factor", type=float, default=1.5)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=700)
    ap.add_argument("--total", type=int, default=19000)
    ap.add_argument("--aux-w", type=float, default=0.01)
    ap.add_argument("--z-w", type=float, default=0.001)
    ap.add_argument("--log-window", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=500)
    return ap.parse_args()


class ShardedTokens(Dataset):
    def __init__(self, path, ctx):
        self.tok = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return len(self.tok) // (self.ctx + 1)

    def __getitem__(self, i):
        a = i * (self.ctx + 1)
        buf = torch.from_numpy(self.tok[a:a + self.ctx + 1].astype(np.int64))
        return buf[:-1], buf[1:]


class RouterStats:
    """Accumulates routing statistics on the host between logging steps."""

    def __init__(self, n_layers, n_exp):
        self.n_layers, self.n_exp = n_layers, n_exp
        self.reset()

    def reset(self):
        self.load = np.zeros((self.n_layers, self.n_exp), dtype=np.float64)
        self.entropy = np.zeros(self.n_layers, dtype=np.float64)
        self.dropped = 0.0
        self.routed = 0.0
        self.steps = 0

    def update(self, per_layer):
        for i, s in enumerate(per_layer):
            self.load[i] += s["counts"].cpu().numpy()
            self.entropy[i] += s["entropy"].item()
            self.dropped += s["dropped"].item()
            self.routed += s["routed"]
        self.steps += 1

    def reduce(self, world):
        flat = np.concatenate([self.load.ravel(), self.entropy, [self.dropped, self.routed]])
        t = torch.from_numpy(flat)
        dist.all_reduce(t)
        t = t.numpy()
        nl = self.n_layers * self.n_exp
        load = t[:nl].reshape(self.n_layers, self.n_exp)
        out = {
            "load_frac": load / load.sum(1, keepdims=True),
            "entropy": t[nl:nl + self.n_layers] / (world * self.steps),
            "drop_rate": t[-2] / max(t[-1], 1.0),
        }
        self.reset()
        return out


class ExpertFFN(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_exp, self.top_k, self.cf = a.n_exp, a.top_k, a.cap_factor
        self.router = nn.Linear(a.d_model, a.n_exp, bias=False)
        self.experts = nn.ModuleList(ExpertFFN(a.d_model, a.d_ff) for _ in range(a.n_exp))

    def forward(self, h):
        B, T, D = h.shape
        x = h.view(-1, D)
        N = x.size(0)
        logits = self.router(x).float()
        probs = F.softmax(logits, dim=-1)
        topw, topi = torch.topk(probs, self.top_k, dim=-1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)

        capacity = math.ceil(self.cf * N * self.top_k / self.n_exp)
        out = torch.zeros_like(x)
        counts = torch.zeros(self.n_exp, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(topi == e)
            tok, slot = tok[:capacity], slot[:capacity]
            counts[e] = tok.numel()
            y = expert(x[tok]) * topw[tok, slot, None]
            out.index_add_(0, tok, y)

        me = probs.mean(0)
        ce = F.one_hot(topi, self.n_exp).float().sum(1).mean(0) / self.top_k
        aux = self.n_exp * (me * ce).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        stats = {
            "counts": counts.detach(),
            "entropy": -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean().detach(),
            "dropped": (N * self.top_k - counts.sum()).detach(),
            "routed": N * self.top_k,
        }
        return out.view(B, T, D), aux, z, stats


class DecoderBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_head = a.n_head
        self.ln1 = nn.RMSNorm(a.d_model)
        self.ln2 = nn.RMSNorm(a.d_model)
        self.wqkv = nn.Linear(a.d_model, 3 * a.d_model, bias=False)
        self.wo = nn.Linear(a.d_model, a.d_model, bias=False)
        self.moe = SparseMoeBlock(a)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.wqkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).transpose(1, 3)
        q, k, v = qkv.unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(B, T, C))
        m, aux, z, stats = self.moe(self.ln2(x))
        return x + m, aux, z, stats


class MoEDecoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.d_model)
        self.pos = nn.Embedding(a.ctx, a.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(a) for _ in range(a.n_layer))
        self.norm = nn.RMSNorm(a.d_model)
        self.head = nn.Linear(a.d_model, a.vocab, bias=False)
        self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        aux = z = 0.0
        stats = []
        for blk in self.blocks:
            x, a_, z_, s_ = blk(x)
            aux, z = aux + a_, z + z_
            stats.append(s_)
        n = len(self.blocks)
        return self.head(self.norm(x)), aux / n, z / n, stats


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_ds = ShardedTokens(os.path.join(a.data_dir, "train.bin"), a.ctx)
    val_ds = ShardedTokens(os.path.join(a.data_dir, "val.bin"), a.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=a.batch, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=a.batch, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2, pin_memory=True)

    model = DDP(MoEDecoder(a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    writer = None
    ckpt_dir = os.path.join(a.ckpt_root, a.run_name)
    if rank == 0:
        writer = SummaryWriter(os.path.join(a.log_root, a.run_name))
        os.makedirs(ckpt_dir, exist_ok=True)
    stats = RouterStats(a.n_layer, a.n_exp)

    step, epoch = 0, 0
    t0 = time.time()
    while step < a.total:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            lr = a.lr * min(1.0, (step + 1) / a.warmup)
            if step > a.warmup:
                lr = 0.1 * a.lr + 0.45 * a.lr * (1 + math.cos(math.pi * (step - a.warmup) / (a.total - a.warmup)))
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z, layer_stats = model(x)
                ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                loss = ce + a.aux_w * aux + a.z_w * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            stats.update(layer_stats)

            if step % a.log_window == 0:
                r = stats.reduce(world)
                ce_avg = ce.detach().clone()
                dist.all_reduce(ce_avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tput = a.log_window * a.batch * a.ctx * world / (time.time() - t0)
                    print(f"step {step} ce {ce_avg.item():.4f} drop {r['drop_rate']:.2%} "
                          f"max_load {r['load_frac'].max():.3f} tok/s {tput:,.0f}", flush=True)
                    writer.add_scalar("train/ce", ce_avg.item(), step)
                    writer.add_scalar("train/lr", lr, step)
                    writer.add_scalar("router/drop_rate", r["drop_rate"], step)
                    for li in range(a.n_layer):
                        writer.add_scalar(f"router/entropy_l{li}", r["entropy"][li], step)
                        writer.add_histogram(f"router/load_l{li}", r["load_frac"][li], step)
                t0 = time.time()

            if step % a.eval_every == 0:
                model.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for i, (vx, vy) in enumerate(val_loader):
                        if i >= 20:
                            break
                        vlog, _, _, _ = model(vx.to(device))
                        acc[0] += F.cross_entropy(vlog.float().view(-1, vlog.size(-1)), vy.to(device).view(-1),
                                                  reduction="sum")
                        acc[1] += vy.numel()
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    vloss = (acc[0] / acc[1]).item()
                    writer.add_scalar("val/loss", vloss, step)
                    print(f"step {step} val {vloss:.4f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(ckpt_dir, "latest.pt"))
                dist.barrier()
            if step >= a.total:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
