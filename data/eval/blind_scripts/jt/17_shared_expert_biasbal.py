"""
DeepSeekMoE-style layer: one shared expert + many fine-grained routed experts (top-k, sigmoid
affinities) with auxiliary-loss-free load balancing (a per-expert routing bias nudged after
every step towards uniform load). Experts are replicated, DDP averages gradients.

    torchrun --nproc_per_node=8 17_shared_expert_biasbal.py --data /nvme/tok/fineweb_edu \
        --wandb_project dsmoe-ablations --run_name fg64_top6
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Bin(Dataset):
    def __init__(self, path, L):
        self.path, self.L = path, L
        self.n = (os.path.getsize(path) // 2 - 1) // L
        self.mm = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        a = torch.from_numpy(self.mm[i * self.L:(i + 1) * self.L + 1].astype(np.int64))
        return a[:-1], a[1:]


class FineGrainedMoE(nn.Module):
    def __init__(self, d, n_routed, top_k, expert_hidden, shared_hidden, capacity_factor):
        super().__init__()
        self.E, self.k, self.cf = n_routed, top_k, capacity_factor
        self.centroids = nn.Linear(d, n_routed, bias=False)
        self.register_buffer("route_bias", torch.zeros(n_routed))
        self.w_gate = nn.Parameter(torch.randn(n_routed, d, expert_hidden) * 0.02)
        self.w_up = nn.Parameter(torch.randn(n_routed, d, expert_hidden) * 0.02)
        self.w_down = nn.Parameter(torch.randn(n_routed, expert_hidden, d) * 0.02)
        self.shared = nn.Sequential(nn.Linear(d, shared_hidden, bias=False), nn.SiLU(),
                                    nn.Linear(shared_hidden, d, bias=False))
        self.last_load = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        n = x.size(0)
        aff = torch.sigmoid(self.centroids(x).float())
        _, e = (aff + self.route_bias).topk(self.k, -1)        # bias only affects selection
        w = aff.gather(-1, e)
        w = w / w.sum(-1, keepdim=True)
        cap = math.ceil(self.cf * n * self.k / self.E)
        ef, wf = e.t().reshape(-1), w.t().reshape(-1)
        tf = torch.arange(n, device=x.device).repeat(self.k)
        oh = F.one_hot(ef, self.E)
        pos = (oh.cumsum(0) * oh).sum(-1) - 1
        keep = pos < cap
        self.last_load = torch.bincount(ef, minlength=self.E).float()
        slot = ef[keep] * cap + pos[keep]
        buf = x.new_zeros(self.E * cap, D)
        buf[slot] = x[tf[keep]]
        buf = buf.view(self.E, cap, D)
        h = F.silu(torch.bmm(buf, self.w_gate)) * torch.bmm(buf, self.w_up)
        out = torch.bmm(h, self.w_down).view(-1, D)
        y = torch.zeros(n, D, device=x.device, dtype=out.dtype)
        y.index_add_(0, tf[keep], out[slot] * wf[keep, None].to(out.dtype))
        return (self.shared(x) + y).to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h = a.heads
        self.rms1 = nn.RMSNorm(a.d)
        self.rms2 = nn.RMSNorm(a.d)
        self.qkv = nn.Linear(a.d, 3 * a.d, bias=False)
        self.o = nn.Linear(a.d, a.d, bias=False)
        self.moe = FineGrainedMoE(a.d, a.routed, a.top_k, a.expert_hidden, a.shared_hidden, a.cf)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.rms1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.rms2(x))


class DSMoELM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.ctx, a.d)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


@torch.no_grad()
def update_route_bias(model, gamma):
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    layers = [b.moe for b in model.blocks]
    load = torch.stack([m.last_load for m in layers])
    dist.all_reduce(load)                      # global load, so every rank applies the same update
    err = load.mean(-1, keepdim=True) - load
    for m, e in zip(layers, err):
        m.route_bias.add_(gamma * torch.sign(e))
    return (load.max(-1).values / load.mean(-1)).mean()   # max-violation, averaged over layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/dsmoe")
    ap.add_argument("--wandb_project", default="dsmoe")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--routed", type=int, default=64)
    ap.add_argument("--top_k", type=int, default=6)
    ap.add_argument("--expert_hidden", type=int, default=384)
    ap.add_argument("--shared_hidden", type=int, default=768)
    ap.add_argument("--cf", type=float, default=1.5)
    ap.add_argument("--bias_gamma", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4.2e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--eval_every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3407)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tr = Bin(os.path.join(args.data, "train.bin"), args.ctx)
    va = Bin(os.path.join(args.data, "val.bin"), args.ctx)
    ts = DistributedSampler(tr, shuffle=True, drop_last=True)
    vs = DistributedSampler(va, shuffle=False, drop_last=True)
    tl = DataLoader(tr, args.batch, sampler=ts, num_workers=4, pin_memory=True, drop_last=True)
    vl = DataLoader(va, args.batch, sampler=vs, num_workers=2, pin_memory=True)

    net = DSMoELM(args).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def evaluate(max_batches=100):
        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for i, (x, y) in enumerate(vl):
                if i == max_batches:
                    break
                logits = model(x.to(device))
                acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum")
                acc[1] += y.numel()
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[1]).item()

    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        ts.set_epoch(epoch)
        for x, y in tl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            maxvio = update_route_bias(net, args.bias_gamma)
            step += 1

            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": l.item(), "train/max_violation": maxvio.item(),
                           "train/grad_norm": gnorm.item(), "lr": sched.get_last_lr()[0],
                           "perf/step_time": (time.time() - t0) / 20}, step=step)
                t0 = time.time()
            if step % args.eval_every == 0:
                val = evaluate()
                wandb.log({"val/loss": val, "val/ppl": math.exp(val)}, step=step)
                if rank == 0:
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, f"step{step}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
