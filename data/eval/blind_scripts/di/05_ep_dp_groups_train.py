"""
MoE transformer LM with expert parallelism inside a node and data parallelism across nodes.

  ranks 0..7   : EP group 0  (each rank holds num_experts/8 experts)
  ranks 8..15  : EP group 1  (replica of the same expert shards)
  expert-DP groups: {0,8}, {1,9}, ...  -> averages the replicas of one shard

Launch (2 nodes x 8 GPUs, shared /mnt/fsx):
  srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=8 \
      --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
      05_ep_dp_groups_train.py --data /mnt/fsx/tok/slimpajama --ckpt /mnt/fsx/ckpt/moe_ep8
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--cf", type=float, default=1.25)
    p.add_argument("--eval-cf", type=float, default=2.0)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--lb-coef", type=float, default=0.01)
    p.add_argument("--z-coef", type=float, default=0.001)
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--ckpt-interval", type=int, default=2000)
    return p.parse_args()


class PackedTokens(Dataset):
    def __init__(self, path, seq):
        self.arr = np.load(path, mmap_mode="r")
        self.seq = seq

    def __len__(self):
        return (self.arr.shape[0] - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(np.asarray(self.arr[i * self.seq: (i + 1) * self.seq + 1], dtype=np.int64))
        return t[:-1], t[1:]


def init_groups(ep):
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % ep == 0, f"world {world} not divisible by ep {ep}"
    ep_group = edp_group = None
    # new_group is collective over the world: all ranks build all groups
    for i in range(world // ep):
        ranks = list(range(i * ep, (i + 1) * ep))
        g = dist.new_group(ranks)
        if rank in ranks:
            ep_group = g
    for j in range(ep):
        ranks = list(range(j, world, ep))
        g = dist.new_group(ranks)
        if rank in ranks:
            edp_group = g
    return ep_group, edp_group


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ExpertParallelMoE(nn.Module):
    def __init__(self, a, ep_group):
        super().__init__()
        self.group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.E, self.k = a.experts, a.topk
        self.n_local = a.experts // self.ep
        self.cf, self.eval_cf = a.cf, a.eval_cf
        self.gate = nn.Linear(a.dim, a.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(a.dim, a.ffn) for _ in range(self.n_local))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N = x.size(0)
        logits = self.gate(x).float()
        probs = logits.softmax(-1)
        w, sel = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)

        f = torch.zeros(self.E, device=x.device).scatter_add_(0, sel.reshape(-1), torch.ones_like(w).reshape(-1))
        lb_loss = self.E * torch.dot(f / (N * self.k), probs.mean(0))
        z_loss = torch.logsumexp(logits, -1).square().mean()

        cap = math.ceil((self.cf if self.training else self.eval_cf) * N * self.k / self.E)
        e_flat, w_flat = sel.t().reshape(-1), w.t().reshape(-1)
        t_flat = torch.arange(N, device=x.device).repeat(self.k)
        rank_in_e = (F.one_hot(e_flat, self.E).cumsum(0) - 1).gather(1, e_flat[:, None]).squeeze(1)
        keep = rank_in_e < cap
        n_dropped = (~keep).sum()
        e_flat, w_flat, t_flat = e_flat[keep], w_flat[keep], t_flat[keep]
        order = e_flat.argsort(stable=True)
        e_flat, w_flat, t_flat = e_flat[order], w_flat[order], t_flat[order]

        # exchange per-expert counts so every rank knows how much it will receive
        send = torch.bincount(e_flat, minlength=self.E)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits = send.view(self.ep, self.n_local).sum(1).tolist()
        recv_mat = recv.view(self.ep, self.n_local)
        recv_splits = recv_mat.sum(1).tolist()

        xin = x[t_flat]
        xrecv = dist_fn.all_to_all_single(xin.new_empty(sum(recv_splits), xin.size(1)), xin,
                                          recv_splits, send_splits, group=self.group)

        # [src rank][local expert] -> [local expert][src rank]
        owner = torch.arange(self.n_local, device=x.device).repeat(self.ep)
        row_e = owner.repeat_interleave(recv_mat.reshape(-1))
        perm = row_e.argsort(stable=True)
        outs = [exp(chunk) for exp, chunk in zip(self.experts, xrecv[perm].split(recv_mat.sum(0).tolist()))]
        yperm = torch.cat(outs)
        yrecv = torch.empty_like(yperm).index_copy(0, perm, yperm)

        yback = dist_fn.all_to_all_single(yrecv.new_empty(sum(send_splits), yrecv.size(1)), yrecv,
                                          send_splits, recv_splits, group=self.group)
        out = torch.zeros_like(x).index_add(0, t_flat, (yback * w_flat[:, None]).to(x.dtype))
        return out.view(shape), lb_loss, z_loss, n_dropped


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, a, ep_group):
        super().__init__()
        self.h = a.heads
        self.n1, self.n2 = RMSNorm(a.dim), RMSNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.moe = ExpertParallelMoE(a, ep_group)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        y, lb, z, nd = self.moe(self.n2(x))
        return x + y, lb, z, nd


class MoELM(nn.Module):
    def __init__(self, a, ep_group):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a, ep_group) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        lb = z = nd = 0
        for b in self.blocks:
            x, l_, z_, n_ = b(x)
            lb, z, nd = lb + l_, z + z_, nd + n_
        L = len(self.blocks)
        return self.lm_head(self.norm(x)), lb / L, z / L, nd


def is_expert(name):
    return ".moe.experts." in name


@torch.no_grad()
def reduce_grads(model, edp_group, world):
    dense = [p.grad for n, p in model.named_parameters() if not is_expert(n)]
    expert = [p.grad for n, p in model.named_parameters() if is_expert(n)]
    for grads, group in ((dense, dist.group.WORLD), (expert, edp_group)):
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(world)  # expert grads already summed over the EP group by the backward all_to_all
        for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(s)


@torch.no_grad()
def global_grad_norm(model, ep_group):
    d = torch.zeros((), device="cuda")
    e = torch.zeros((), device="cuda")
    for n, p in model.named_parameters():
        if is_expert(n):
            e += p.grad.float().square().sum()
        else:
            d += p.grad.float().square().sum()
    dist.all_reduce(e, group=ep_group)
    return (d + e).sqrt()


def save(model, opt, it, a, rank, ep_rank, edp_rank):
    os.makedirs(a.ckpt, exist_ok=True)
    sd = model.state_dict()
    osd = opt.state_dict()
    if rank == 0:
        torch.save({"model": {k: v for k, v in sd.items() if not is_expert(k)}, "it": it},
                   os.path.join(a.ckpt, "dense.pt"))
    if edp_rank == 0:  # one writer per expert shard
        torch.save({"model": {k: v for k, v in sd.items() if is_expert(k)}},
                   os.path.join(a.ckpt, f"experts_ep{ep_rank:02d}of{a.ep:02d}.pt"))
    # optimizer state differs per rank only through the expert shard, so one file per EP rank as well
    if edp_rank == 0:
        torch.save(osd, os.path.join(a.ckpt, f"optim_ep{ep_rank:02d}of{a.ep:02d}.pt"))
    dist.barrier()


def load(model, opt, a, ep_rank, device):
    dense_path = os.path.join(a.ckpt, "dense.pt")
    if not os.path.exists(dense_path):
        return 0
    dense = torch.load(dense_path, map_location=device)
    experts = torch.load(os.path.join(a.ckpt, f"experts_ep{ep_rank:02d}of{a.ep:02d}.pt"), map_location=device)
    model.load_state_dict({**dense["model"], **experts["model"]})
    opt.load_state_dict(torch.load(os.path.join(a.ckpt, f"optim_ep{ep_rank:02d}of{a.ep:02d}.pt"),
                                   map_location=device))
    return dense["it"]


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    ep_group, edp_group = init_groups(a.ep)
    ep_rank, edp_rank = dist.get_rank(ep_group), dist.get_rank(edp_group)

    torch.manual_seed(1337)
    model = MoELM(a, ep_group)
    # dense weights identical everywhere; expert shards seeded by their EP rank so replicas match
    g = torch.Generator().manual_seed(2024 + ep_rank)
    for n, p in model.named_parameters():
        if is_expert(n):
            with torch.no_grad():
                p.normal_(0.0, 0.02, generator=g)
    model.to(device)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = load(model, opt, a, ep_rank, device)

    train = PackedTokens(os.path.join(a.data, "train.npy"), a.seq)
    val = PackedTokens(os.path.join(a.data, "val.npy"), a.seq)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(train, batch_size=a.mbs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    vsampler = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    vloader = DataLoader(val, batch_size=a.mbs, sampler=vsampler, num_workers=2, pin_memory=True, drop_last=True)

    steps_per_epoch = len(loader)
    it = start
    model.train()
    tstart = time.time()
    while it < a.iters:
        sampler.set_epoch(it // steps_per_epoch)
        for x, y in loader:
            if it >= a.iters:
                break
            lr = a.lr * min(1.0, (it + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * it / a.iters))
            for pg in opt.param_groups:
                pg["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, lb, z, nd = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + a.lb_coef * lb + a.z_coef * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            reduce_grads(model, edp_group, world)
            gn = global_grad_norm(model, ep_group)
            clip = (1.0 / (gn + 1e-6)).clamp(max=1.0)
            for prm in model.parameters():
                prm.grad.mul_(clip)
            opt.step()
            it += 1

            if it % 10 == 0:
                m = torch.stack([ce.detach(), lb.detach(), nd.float(), gn])
                dist.all_reduce(m)
                if rank == 0:
                    dropped = m[2] / (world * x.numel() * a.topk * a.layers)
                    print(f"it {it} ce {m[0] / world:.4f} lb {m[1] / world:.4f} dropped {dropped:.2%} "
                          f"gnorm {m[3] / world:.3f} lr {lr:.2e} {time.time() - tstart:.0f}s", flush=True)

            if it % a.eval_interval == 0:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for j, (vx, vy) in enumerate(vloader):
                        if j == 20:
                            break
                        vlog, *_ = model(vx.to(device))
                        tot[0] += F.cross_entropy(vlog.float().flatten(0, 1), vy.to(device).flatten(),
                                                  reduction="sum")
                        tot[1] += vy.numel()
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    print(f"it {it} val_loss {tot[0] / tot[1]:.4f}", flush=True)

            if it % a.ckpt_interval == 0:
                save(model, opt, it, a, rank, ep_rank, edp_rank)

    save(model, opt, it, a, rank, ep_rank, edp_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
