"""Masked-autoencoder pretraining of a 3D ViT on DNS turbulence cubes
(isotropic + channel flow, 128^3 crops of u, v, w, p cut into 8^3 patches).
The encoder is ~1.3B parameters, so it is trained with FSDP.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        14_fsdp_mae3d_turbulence.py --run-dir /lustre/orion/cfd/mae3d/run01
"""
import argparse
import functools
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CubeCrops(Dataset):
    def __init__(self, files, crop=128, crops_per_file=64, stats=None):
        self.files, self.crop, self.cpf = files, crop, crops_per_file
        self.mean, self.std = stats

    def __len__(self):
        return len(self.files) * self.cpf

    def __getitem__(self, i):
        path = self.files[i // self.cpf]
        rng = np.random.default_rng()
        with h5py.File(path, "r") as f:
            d = f["fields"]  # (4, N, N, N)
            n = d.shape[1]
            o = rng.integers(0, n - self.crop, size=3)
            x = d[:, o[0]: o[0] + self.crop, o[1]: o[1] + self.crop, o[2]: o[2] + self.crop]
        x = (x.astype(np.float32) - self.mean[:, None, None, None]) / self.std[:, None, None, None]
        return torch.from_numpy(x)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MAE3D(nn.Module):
    def __init__(self, in_ch=4, vol=128, patch=8, dim=1536, depth=40, heads=16, dec_dim=512, dec_depth=8):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.n = (vol // patch) ** 3
        self.embed = nn.Conv3d(in_ch, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, self.n, dim) * 0.02)
        self.encoder = nn.ModuleList([TransformerBlock(dim, heads) for _ in range(depth)])
        self.enc_norm = nn.LayerNorm(dim)
        self.to_dec = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos = nn.Parameter(torch.randn(1, self.n, dec_dim) * 0.02)
        self.decoder = nn.ModuleList([TransformerBlock(dec_dim, 8) for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.head = nn.Linear(dec_dim, in_ch * patch ** 3)

    def patchify(self, x):
        B, C, D, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, D // p, p, H // p, p, W // p, p)
        return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(B, self.n, -1)

    def forward(self, x, mask_ratio=0.75):
        B = x.shape[0]
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        n_keep = int(self.n * (1 - mask_ratio))
        noise = torch.rand(B, self.n, device=x.device)
        ids_shuffle = noise.argsort(dim=1)
        ids_restore = ids_shuffle.argsort(dim=1)
        keep = ids_shuffle[:, :n_keep]
        h = torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
        for blk in self.encoder:
            h = blk(h)
        h = self.to_dec(self.enc_norm(h))
        h = torch.cat([h, self.mask_token.expand(B, self.n - n_keep, -1)], 1)
        h = torch.gather(h, 1, ids_restore[..., None].expand(-1, -1, h.shape[-1])) + self.dec_pos
        for blk in self.decoder:
            h = blk(h)
        pred = self.head(self.dec_norm(h))
        target = self.patchify(x)
        mask = torch.ones(B, self.n, device=x.device)
        mask[:, :n_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        loss = (((pred.float() - target) ** 2).mean(-1) * mask).sum() / mask.sum()
        return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-glob", default="/lustre/orion/cfd/dns/*/snap_*.h5")
    ap.add_argument("--stats", default="/lustre/orion/cfd/dns/channel_stats.npz")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(args.data_glob))
    s = np.load(args.stats)
    ds = CubeCrops(files, stats=(s["mean"], s["std"]))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=7,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MAE3D()
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=local_rank,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 limit_all_gathers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda st: min(1.0, (st + 1) / args.warmup) * 0.5 * (1 + np.cos(np.pi * st / total)))

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        print(f"{len(files)} snapshots, {len(ds)} crops/epoch, world {world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x in loader:
            x = x.to(device, non_blocking=True)
            loss = model(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.save_every == 0:
            if rank == 0:
                cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    state = model.state_dict()
                torch.save({"model": state, "epoch": epoch, "step": step},
                           os.path.join(args.run_dir, f"mae3d_ep{epoch:03d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
