"""FrameFlow-lite: SE(3) flow matching on residue frames with self-conditioning.

- translations: linear interpolation from Gaussian noise
- rotations: geodesic interpolation from uniform SO(3) noise
- self-conditioning: with p=0.5 a first no-grad pass predicts x1, fed back as input
- activation checkpointing of trunk blocks, gradient accumulation

    torchrun --nproc_per_node=8 12_frameflow_selfcond.py --data /shared/pdb/frames_len60_384.pt --out /shared/runs/frameflow
"""
import argparse
import os
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def hat(v):
    z = torch.zeros_like(v[..., 0])
    return torch.stack([z, -v[..., 2], v[..., 1], v[..., 2], z, -v[..., 0], -v[..., 1], v[..., 0], z], -1
                       ).view(*v.shape[:-1], 3, 3)


def so3_exp(v):
    th = v.norm(dim=-1, keepdim=True)[..., None].clamp(min=1e-6)
    K = hat(v) / th
    I = torch.eye(3, device=v.device, dtype=v.dtype).expand_as(K)
    return I + th.sin() * K + (1 - th.cos()) * (K @ K)


def so3_log(R):
    cos = ((R.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1 + 1e-6, 1 - 1e-6)
    th = torch.acos(cos)
    w = torch.stack([R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]], -1)
    return w * (th / (2 * th.sin()))[..., None]


def uniform_so3(shape, device):
    q = F.normalize(torch.randn(*shape, 4, device=device), dim=-1)
    return so3_exp(2 * torch.atan2(q[..., 1:].norm(dim=-1, keepdim=True), q[..., :1]) * F.normalize(q[..., 1:], dim=-1))


class FrameData(Dataset):
    def __init__(self, items):
        self.items = items  # dicts with rots [L,3,3], trans [L,3] (nm, centred), mask [L]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return it["rots"], it["trans"], it["mask"]


class IPALiteBlock(nn.Module):
    def __init__(self, d, h=8):
        super().__init__()
        self.h = h
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.pair = nn.Linear(32, h)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, s, pair_feat, mask):
        B, L, D = s.shape
        q, k, v = self.qkv(self.ln(s)).view(B, L, 3, self.h, D // self.h).unbind(2)
        logits = torch.einsum("bihc,bjhc->bhij", q, k) * (D // self.h) ** -0.5
        logits = logits + self.pair(pair_feat).permute(0, 3, 1, 2)
        logits = logits.masked_fill(~mask[:, None, None, :], -1e4)
        o = torch.einsum("bhij,bjhc->bihc", logits.softmax(-1), v).reshape(B, L, D)
        s = s + self.out(o)
        return s + self.mlp(s)


class FrameFlowNet(nn.Module):
    def __init__(self, d=256, depth=8, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.node_in = nn.Linear(64 + 1, d)
        self.pair_in = nn.Linear(16 + 16, 32)  # current distances + self-conditioned distances
        self.blocks = nn.ModuleList([IPALiteBlock(d) for _ in range(depth)])
        self.trans_head = nn.Linear(d, 3)
        self.rot_head = nn.Linear(d, 3)

    def rbf(self, x):
        d = torch.cdist(x, x)
        return torch.exp(-((d[..., None] - torch.linspace(0, 2.0, 16, device=x.device)) ** 2) / 0.02)

    def forward(self, rots_t, trans_t, t, mask, sc_trans):
        B, L = mask.shape
        pos = torch.arange(L, device=mask.device)[:, None] * torch.exp(
            -torch.arange(0, 64, 2, device=mask.device) * (9.2 / 64))
        pos_emb = torch.cat([pos.sin(), pos.cos()], -1)[None].expand(B, -1, -1)
        s = self.node_in(torch.cat([pos_emb, t[:, None, None].expand(B, L, 1)], -1))
        z = self.pair_in(torch.cat([self.rbf(trans_t), self.rbf(sc_trans)], -1))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                s = checkpoint(blk, s, z, mask, use_reentrant=False)
            else:
                s = blk(s, z, mask)
        # local-frame outputs -> global
        pred_trans = trans_t + torch.einsum("blij,blj->bli", rots_t, self.trans_head(s))
        pred_rots = rots_t @ so3_exp(self.rot_head(s))
        return pred_rots, pred_trans * mask[..., None]


def interpolate(rots1, trans1, mask, t):
    B, L = mask.shape
    rots0 = uniform_so3((B, L), mask.device)
    trans0 = torch.randn_like(trans1)
    trans0 = trans0 - (trans0 * mask[..., None]).sum(1, keepdim=True) / mask.sum(1)[:, None, None]
    tt = t[:, None, None]
    trans_t = ((1 - tt) * trans0 + tt * trans1) * mask[..., None]
    rel = so3_log(rots0.transpose(-1, -2) @ rots1)
    rots_t = rots0 @ so3_exp(tt * rel)
    return rots_t, trans_t


def flow_loss(model, rots1, trans1, mask, self_cond):
    t = torch.rand(mask.shape[0], device=mask.device) * 0.95
    rots_t, trans_t = interpolate(rots1, trans1, mask, t)
    sc = torch.zeros_like(trans_t)
    if self_cond:
        with torch.no_grad():
            _, sc = model(rots_t, trans_t, t, mask, sc)
    pr, pt = model(rots_t, trans_t, t, mask, sc.detach())
    m = mask[..., None].float()
    w = 1.0 / (1 - t).clamp(min=0.1)[:, None, None]
    trans_l = (((pt - trans1) ** 2) * m * w ** 2).sum() / (m.sum() * 3)
    rot_l = ((so3_log(pr.transpose(-1, -2) @ rots1) ** 2) * m).sum() / (m.sum() * 3)
    return trans_l + 0.5 * rot_l


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    items = torch.load(args.data, map_location="cpu")
    n_val = 512
    train_ds, val_ds = FrameData(items[n_val:]), FrameData(items[:n_val])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, n_val, world)), batch_size=args.micro_bs)

    net = FrameFlowNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = FrameFlowNet(grad_ckpt=False).to(device).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pt")
    epoch0 = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        epoch0 = ck["epoch"] + 1

    # per-rank noise; the self-conditioning coin comes from its own generator,
    # seeded the same everywhere, so all ranks run the same number of forwards
    torch.manual_seed(1 + rank)
    sc_coin = torch.Generator().manual_seed(1234 + epoch0)

    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        opt.zero_grad(set_to_none=True)
        for i, (rots, trans, mask) in enumerate(loader):
            rots, trans, mask = rots.to(device), trans.to(device), mask.to(device)
            last_micro = (i + 1) % args.accum == 0
            ctx = nullcontext() if last_micro else model.no_sync()
            with ctx:
                loss = flow_loss(model, rots, trans, mask, self_cond=bool(torch.rand((), generator=sc_coin) < 0.5))
                (loss / args.accum).backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for pe, p in zip(ema.parameters(), net.parameters()):
                        pe.lerp_(p, 1 - args.ema)

        ema.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for rots, trans, mask in val_loader:
                rots, trans, mask = rots.to(device), trans.to(device), mask.to(device)
                acc[0] += flow_loss(ema, rots, trans, mask, self_cond=True) * mask.shape[0]
                acc[1] += mask.shape[0]
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val_loss(ema) {(acc[0] / acc[1]).item():.4f} time {time.time() - tic:.0f}s",
                  flush=True)
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
