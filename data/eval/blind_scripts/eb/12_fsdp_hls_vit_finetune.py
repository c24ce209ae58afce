"""Fine-tune a ViT-L geospatial foundation model (MAE-pretrained on HLS) for
multi-temporal land-cover change segmentation, sharded with FSDP on 2 nodes.

Input: 3 HLS time steps x 6 bands (B, G, R, NIR, SWIR1, SWIR2), 224 x 224 chips.
Output: 5 change classes per pixel.  Train/val split is by HLS MGRS tile.

Launched on each node (shared /lustre file system):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        12_fsdp_hls_vit_finetune.py --pretrained /lustre/eo/models/vitl_hls_mae.pt \
        --data /lustre/eo/hls_change --out /lustre/eo/runs/vitl_change
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

T, C, IMG, PATCH, N_CLS = 3, 6, 224, 16, 5


class HLSChangeChips(Dataset):
    def __init__(self, root, split):
        d = np.load(os.path.join(root, f"{split}_index.npz"))
        self.files, self.root = list(d["files"]), root
        self.mean = d["mean"].astype(np.float32).reshape(1, C, 1, 1)
        self.std = d["std"].astype(np.float32).reshape(1, C, 1, 1)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        valid = 1.0
        if i < 0:  # padding slot from PaddedEvalSampler
            i, valid = 0, 0.0
        z = np.load(os.path.join(self.root, self.files[i]))
        x = (z["x"].astype(np.float32) - self.mean) / self.std   # (T, C, H, W)
        return torch.from_numpy(x), torch.from_numpy(z["y"].astype(np.int64)), torch.tensor(valid)


class PaddedEvalSampler(Sampler):
    """Strided shard; every rank yields the same count (FSDP forwards must stay in lockstep).
    Missing slots are -1 and are masked out of the metrics."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))
        self.len = math.ceil(n / world)
        self.idx += [-1] * (self.len - len(self.idx))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return self.len


class ViTChangeSeg(nn.Module):
    def __init__(self, dim=1024, depth=24, heads=16):
        super().__init__()
        self.patch_embed = nn.Conv3d(C, dim, kernel_size=(1, PATCH, PATCH), stride=(1, PATCH, PATCH))
        n = T * (IMG // PATCH) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, n, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.neck = nn.Conv2d(dim * T, 256, 1)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(256, 128, 2, 2), nn.GroupNorm(16, 128), nn.GELU(),
            nn.ConvTranspose2d(128, 64, 2, 2), nn.GroupNorm(16, 64), nn.GELU(),
            nn.ConvTranspose2d(64, 64, 2, 2), nn.GroupNorm(16, 64), nn.GELU(),
            nn.ConvTranspose2d(64, 32, 2, 2), nn.GroupNorm(8, 32), nn.GELU(),
            nn.Conv2d(32, N_CLS, 1))

    def forward(self, x):                                   # x: (B, T, C, H, W)
        b = x.shape[0]
        x = self.patch_embed(x.transpose(1, 2))             # (B, D, T, h, w)
        d, t, h, w = x.shape[1:]
        x = x.flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x).transpose(1, 2).reshape(b, d, t, h, w).flatten(1, 2)
        return self.decoder(self.neck(x))


def load_pretrained(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k.replace("encoder.", ""): v for k, v in sd.items() if not k.startswith("decoder")}
    own = model.state_dict()
    sd = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


def save_checkpoint(model, opt, sched, epoch, path, rank):
    # every rank takes part in gathering; only rank 0 ends up holding the full dict
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "epoch": epoch},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(N_CLS * N_CLS, device=device, dtype=torch.float64)
    for x, y, valid in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        keep = valid.to(device).bool()[:, None, None].expand_as(y)
        conf += torch.bincount((y * N_CLS + pred)[keep], minlength=N_CLS * N_CLS).double()
    dist.all_reduce(conf)
    conf = conf.view(N_CLS, N_CLS)
    iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1)
    return iou.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--layer-decay-free-lr-mult", type=float, default=10.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    train_ds, val_ds = HLSChangeChips(args.data, "train"), HLSChangeChips(args.data, "val")
    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, per_gpu, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, per_gpu, sampler=PaddedEvalSampler(len(val_ds), rank, world),
                        num_workers=8, pin_memory=True)

    model = ViTChangeSeg()
    ckpt_path = os.path.join(args.out, "last.pt")
    resume = None
    if args.resume and os.path.exists(ckpt_path):
        resume = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(resume["model"])
    else:
        missing, _ = load_pretrained(model, args.pretrained)
        if rank == 0:
            print(f"pretrained encoder loaded, {len(missing)} keys newly initialised")

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
    )

    enc = [p for n, p in model.named_parameters() if n.startswith(("blocks", "patch_embed", "pos_embed"))]
    head = [p for n, p in model.named_parameters() if not n.startswith(("blocks", "patch_embed", "pos_embed"))]
    opt = torch.optim.AdamW([{"params": enc, "lr": args.lr},
                             {"params": head, "lr": args.lr * args.layer_decay_free_lr_mult}],
                            weight_decay=0.05)
    start_epoch = 0
    if resume is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, resume["optim"]))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    if resume is not None:
        sched.load_state_dict(resume["sched"])
        start_epoch = resume["epoch"] + 1
        del resume
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y, _) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)
        miou = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} mIoU {miou:.4f} ({time.time() - t0:.0f}s)", flush=True)
        save_checkpoint(model, opt, sched, epoch, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
