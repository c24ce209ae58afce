"""H->bb vs QCD large-R jet tagging on the CMS open data (HiggsToBBNTuple) with a
deep particle transformer, sharded with FSDP (the 24-layer model does not fit a
useful batch per GPU otherwise).

The ROOT ntuples are converted once into a single npz cache by rank 0.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        17_hbb_fsdp_part.py --root-glob "/eos/opendata/cms/hbb/train/ntuple_merged_*.root" \
        --work-dir /shared/project/hbb_part
"""
import argparse
import functools
import glob
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import uproot
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PF_VARS = ["pfcand_ptrel", "pfcand_erel", "pfcand_etarel", "pfcand_phirel", "pfcand_deltaR",
           "pfcand_puppiw", "pfcand_drminsv", "pfcand_charge"]
N_PART = 100


def build_cache(pattern, cache_path):
    feats, labels = [], []
    branches = PF_VARS + ["fj_isH", "fj_isQCD", "sample_isQCD", "fj_pt", "fj_sdmass"]
    for arr in uproot.iterate(f"{pattern}:deepntuplizer/tree", branches, library="np", step_size=50000):
        sel = ((arr["fj_isH"] == 1) | ((arr["fj_isQCD"] == 1) & (arr["sample_isQCD"] == 1))) & \
              (arr["fj_pt"] > 300) & (arr["fj_sdmass"] > 40) & (arr["fj_sdmass"] < 200)
        n = int(sel.sum())
        block = np.zeros((n, len(PF_VARS), N_PART), dtype=np.float32)
        for vi, v in enumerate(PF_VARS):
            for ji, jag in enumerate(arr[v][sel]):
                m = min(len(jag), N_PART)
                block[ji, vi, :m] = jag[:m]
        feats.append(block)
        labels.append(arr["fj_isH"][sel].astype(np.int64))
    tmp = cache_path + ".tmp.npz"
    np.savez(tmp, x=np.concatenate(feats), y=np.concatenate(labels))
    os.replace(tmp, cache_path)


class Block(nn.Module):
    def __init__(self, d, heads, drop=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(drop), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DeepParT(nn.Module):
    def __init__(self, n_in=len(PF_VARS), d=384, heads=12, depth=24, n_classes=2):
        super().__init__()
        self.embed = nn.Sequential(nn.LayerNorm(n_in), nn.Linear(n_in, d), nn.GELU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, n_classes)

    def forward(self, x):
        x = x.transpose(1, 2)                      # [B, P, F]
        pad = x.abs().sum(-1) == 0
        h = self.embed(x)
        h = torch.cat([self.cls.expand(h.size(0), -1, -1), h], 1)
        pad = torch.cat([torch.zeros_like(pad[:, :1]), pad], 1)
        for blk in self.blocks:
            h = blk(h, pad)
        return self.fc(self.norm(h[:, 0]))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root-glob", required=True)
    ap.add_argument("--work-dir", required=True, help="on the shared filesystem")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val-frac", type=float, default=0.1)
    return ap.parse_args()


def save_checkpoint(model, opt, epoch, path, rank):
    # every rank takes part in gathering the full state; only rank 0 gets (and writes) it
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state, "epoch": epoch}, path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run converts the ROOT files on rank 0 while the others wait in the barrier
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cache = os.path.join(args.work_dir, "hbb_cache.npz")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        if not os.path.exists(cache):
            build_cache(args.root_glob, cache)
    dist.barrier()
    with np.load(cache) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])

    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = int(args.val_frac * len(y))
    n_val -= n_val % world  # equal shards: FSDP runs collectives in every forward
    tr, va = perm[n_val:], perm[:n_val][rank::world]
    train_ds, val_ds = TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=512, num_workers=2, pin_memory=True)

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(DeepParT(), auto_wrap_policy=wrap, device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (xb, yb) in enumerate(train_dl):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for xb, yb in val_dl:
                xb, yb = xb.to(device), yb.to(device)
                logits = model(xb).float()
                acc[0] += F.cross_entropy(logits, yb, reduction="sum")
                acc[1] += (logits.argmax(1) == yb).sum()
                acc[2] += yb.numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val_loss {(acc[0] / acc[2]).item():.4f} "
                  f"val_acc {(acc[1] / acc[2]).item():.4f}", flush=True)
        save_checkpoint(model, opt, epoch, os.path.join(args.work_dir, f"part_epoch{epoch:02d}.pt"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
