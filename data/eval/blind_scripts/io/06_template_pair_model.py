"""Evoformer-lite: MSA + pair trunk with an optional template pair embedder.

Features per chain are precomputed into npz files:
    msa         (N, L) int8   aligned MSA, query first
    cb_dist     (L, L) f32    target C-beta distances (nan = unresolved)
    tmpl_dist   (T, L, L) f32 template C-beta distances (absent if HHsearch found nothing)

Training uses AlphaFold-style contiguous crops, one crop per GPU.

    torchrun --nproc_per_node=8 06_template_pair_model.py --feat_dir /data/af_feats --train_list lists/train.txt
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_AA = 22           # 20 aa + X + gap
MASK_TOK = N_AA     # extra input token for masked MSA positions
N_BINS = 64
TMPL_BINS = 39


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--feat_dir", required=True)
    p.add_argument("--train_list", required=True)
    p.add_argument("--val_list", default=None)
    p.add_argument("--crop", type=int, default=256)
    p.add_argument("--max_msa", type=int, default=128)
    p.add_argument("--c_m", type=int, default=128)
    p.add_argument("--c_z", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--steps", type=int, default=80000)
    p.add_argument("--ckpt_dir", default="ckpt/evo_lite")
    p.add_argument("--log_dir", default="tb/evo_lite")
    return p.parse_args()


def bin_distances(d, lo, hi, n):
    edges = torch.linspace(lo, hi, n - 1)
    return torch.bucketize(d, edges)


class AFFeatureDataset(Dataset):
    def __init__(self, list_file, feat_dir, crop, max_msa):
        with open(list_file) as f:
            self.names = [l.strip() for l in f if l.strip()]
        self.feat_dir, self.crop, self.max_msa = feat_dir, crop, max_msa

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        f = np.load(os.path.join(self.feat_dir, self.names[i] + ".npz"))
        msa = torch.from_numpy(f["msa"].astype(np.int64))
        dist_ = torch.from_numpy(f["cb_dist"]).float()
        tmpl = torch.from_numpy(f["tmpl_dist"]).float() if "tmpl_dist" in f.files else None
        N, L = msa.shape
        if N > self.max_msa:
            keep = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(N - 1)[:self.max_msa - 1]])
            msa = msa[keep]
        if L > self.crop:
            s = random.randint(0, L - self.crop)
            msa = msa[:, s:s + self.crop]
            dist_ = dist_[s:s + self.crop, s:s + self.crop]
            if tmpl is not None:
                tmpl = tmpl[:, s:s + self.crop, s:s + self.crop]
        item = {
            "msa": msa,
            "target": bin_distances(torch.nan_to_num(dist_, nan=0.0), 2.3125, 21.6875, N_BINS),
            "pair_mask": ~torch.isnan(dist_),
        }
        if tmpl is not None:
            t = bin_distances(torch.nan_to_num(tmpl, nan=50.0), 3.25, 50.75, TMPL_BINS)
            item["tmpl"] = F.one_hot(t, TMPL_BINS).float().mean(0)      # L x L x TMPL_BINS
        return item


def collate_single(batch):
    assert len(batch) == 1, "one crop per GPU"
    return {k: v.unsqueeze(0) for k, v in batch[0].items()}


class RowAttentionWithPairBias(nn.Module):
    def __init__(self, c_m, c_z, heads=8):
        super().__init__()
        self.h, self.d = heads, c_m // heads
        self.norm_m, self.norm_z = nn.LayerNorm(c_m), nn.LayerNorm(c_z)
        self.qkv = nn.Linear(c_m, 3 * c_m, bias=False)
        self.bias = nn.Linear(c_z, heads, bias=False)
        self.gate = nn.Linear(c_m, c_m)
        self.out = nn.Linear(c_m, c_m)

    def forward(self, m, z):
        B, N, L, C = m.shape
        x = self.norm_m(m)
        q, k, v = self.qkv(x).view(B, N, L, 3, self.h, self.d).unbind(3)
        b = self.bias(self.norm_z(z)).permute(0, 3, 1, 2)[:, None]              # B 1 H L L
        att = torch.einsum("bnihd,bnjhd->bnhij", q, k) / math.sqrt(self.d) + b
        o = torch.einsum("bnhij,bnjhd->bnihd", att.softmax(-1), v).reshape(B, N, L, C)
        return m + self.out(torch.sigmoid(self.gate(x)) * o)


class OuterProductMean(nn.Module):
    def __init__(self, c_m, c_z, c=32):
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.a, self.b = nn.Linear(c_m, c), nn.Linear(c_m, c)
        self.out = nn.Linear(c * c, c_z)

    def forward(self, m, z):
        x = self.norm(m)
        a, b = self.a(x), self.b(x)
        o = torch.einsum("bnic,bnjd->bijcd", a, b) / m.shape[1]
        return z + self.out(o.flatten(-2))


class PairTransition(nn.Module):
    def __init__(self, c_z):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(c_z), nn.Linear(c_z, 4 * c_z), nn.ReLU(), nn.Linear(4 * c_z, c_z))

    def forward(self, z):
        return z + self.net(z)


class EvoBlock(nn.Module):
    def __init__(self, c_m, c_z):
        super().__init__()
        self.row = RowAttentionWithPairBias(c_m, c_z)
        self.msa_ff = nn.Sequential(nn.LayerNorm(c_m), nn.Linear(c_m, 4 * c_m), nn.ReLU(), nn.Linear(4 * c_m, c_m))
        self.opm = OuterProductMean(c_m, c_z)
        self.pair_ff = PairTransition(c_z)

    def forward(self, m, z):
        m = self.row(m, z)
        m = m + self.msa_ff(m)
        z = self.opm(m, z)
        return m, self.pair_ff(z)


class TemplatePairEmbedder(nn.Module):
    def __init__(self, c_z):
        super().__init__()
        self.proj = nn.Linear(TMPL_BINS, c_z)
        self.blocks = nn.ModuleList([PairTransition(c_z) for _ in range(2)])
        self.norm = nn.LayerNorm(c_z)

    def forward(self, t):
        x = self.proj(t)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class EvoLite(nn.Module):
    def __init__(self, c_m, c_z, n_blocks, max_rel=32):
        super().__init__()
        self.msa_emb = nn.Embedding(N_AA + 1, c_m)
        self.left, self.right = nn.Linear(N_AA + 1, c_z), nn.Linear(N_AA + 1, c_z)
        self.max_rel = max_rel
        self.relpos = nn.Embedding(2 * max_rel + 1, c_z)
        self.template = TemplatePairEmbedder(c_z)
        self.blocks = nn.ModuleList([EvoBlock(c_m, c_z) for _ in range(n_blocks)])
        self.dist_head = nn.Linear(c_z, N_BINS)
        self.msa_head = nn.Linear(c_m, N_AA)

    def forward(self, msa, tmpl=None):
        L = msa.shape[-1]
        q = F.one_hot(msa[:, 0], N_AA + 1).float()
        pos = torch.arange(L, device=msa.device)
        rel = (pos[None] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        z = self.left(q)[:, :, None] + self.right(q)[:, None, :] + self.relpos(rel)[None]
        if tmpl is not None:
            z = z + self.template(tmpl)
        m = self.msa_emb(msa)
        for blk in self.blocks:
            m, z = blk(m, z)
        logits = self.dist_head(z)
        return 0.5 * (logits + logits.transpose(1, 2)), self.msa_head(m)


def masked_msa(msa, p=0.15):
    mask = torch.rand(msa.shape, device=msa.device) < p
    corrupted = msa.masked_fill(mask, MASK_TOK)
    return corrupted, mask


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = EvoLite(args.c_m, args.c_z, args.blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * (0.95 ** (s // 10000)))

    ds = AFFeatureDataset(args.train_list, args.feat_dir, args.crop, args.max_msa)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, collate_fn=collate_single,
                        num_workers=4, pin_memory=True)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    start = 0
    ckpt_path = os.path.join(args.ckpt_dir, "latest.pt")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]

    step, epoch = start, start // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            msa_in, msa_mask = masked_msa(batch["msa"])
            with torch.autocast("cuda", dtype=torch.bfloat16):
                dist_logits, msa_logits = model(msa_in, batch.get("tmpl"))
            pm = batch["pair_mask"]
            dist_loss = F.cross_entropy(dist_logits.float()[pm], batch["target"][pm])
            msa_loss = F.cross_entropy(msa_logits.float()[msa_mask], batch["msa"][msa_mask]) \
                if msa_mask.any() else msa_logits.sum() * 0.0
            loss = dist_loss + 2.0 * msa_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                logged = torch.stack([dist_loss.detach(), msa_loss.detach()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/distogram", logged[0].item(), step)
                    writer.add_scalar("train/masked_msa", logged[1].item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
            if step % 2000 == 0:
                if rank == 0:
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
