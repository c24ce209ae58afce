"""
Temporal MAE pretraining (Prithvi-style ViT-L, 3 timesteps x 6 HLS bands) with FSDP.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        09_fsdp_prithvi_mae.py --zarr /lustre/hls/chips_224_t3.zarr --ckpt-dir /lustre/runs/prithvi_l
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import zarr
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from prithvi_mae import PrithviMAE, TemporalViTBlock

HLS_BANDS = ["Blue", "Green", "Red", "NIR_Narrow", "SWIR1", "SWIR2"]
HLS_MEAN = [775.23, 1080.99, 1228.59, 2497.20, 2204.21, 1610.83]
HLS_STD = [1281.53, 1270.03, 1399.48, 1368.34, 1291.68, 1154.51]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--mask-ratio", type=float, default=0.75)
    p.add_argument("--num-frames", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


class HLSChips(Dataset):
    """Zarr array 'chips' of shape (N, T, C, 224, 224), int16, -9999 = fill."""

    def __init__(self, path, num_frames):
        self.path = path
        self.num_frames = num_frames
        self.mean = torch.tensor(HLS_MEAN).view(1, -1, 1, 1)
        self.std = torch.tensor(HLS_STD).view(1, -1, 1, 1)
        self.length = zarr.open(path, mode="r")["chips"].shape[0]
        self.arr = None

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = zarr.open(self.path, mode="r")["chips"]
        x = torch.from_numpy(self.arr[i, : self.num_frames].astype(np.float32))  # T, C, H, W
        x = torch.where(x == -9999, self.mean.expand_as(x), x)
        x = (x - self.mean) / self.std
        if torch.rand(1).item() < 0.5:
            x = x.flip(-1)
        return x.permute(1, 0, 2, 3).contiguous()  # C, T, H, W


def lr_for(epoch, args):
    if epoch < args.warmup_epochs:
        return args.lr * epoch / args.warmup_epochs
    t = (epoch - args.warmup_epochs) / max(1, args.epochs - args.warmup_epochs)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * t))


def save_checkpoint(model, optimizer, epoch, step, path, rank):
    # every rank takes part in gathering; only rank 0 ends up holding (and writing) the full tensors
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optimizer": optim_state, "epoch": epoch, "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000)  # same initial weights on every rank (replicas of a shard must match)

    model = PrithviMAE(img_size=224, patch_size=16, num_frames=args.num_frames, tubelet_size=1,
                       in_chans=len(HLS_BANDS), embed_dim=1024, depth=24, num_heads=16,
                       decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, norm_pix_loss=False)

    start_epoch, step = 0, 0
    ckpt = None
    if args.resume:
        # full (unsharded) checkpoint: load into the plain module on every rank before wrapping
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    # decide weight decay by the original names/shapes: after wrapping, the exposed params are flat shards
    no_decay_names = {n for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n or "token" in n}

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TemporalViTBlock})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=local_rank,
        use_orig_params=True,
        limit_all_gathers=True,
        sync_module_states=True,
    )
    torch.manual_seed(1000 + rank)  # from here on: per-rank masking / augmentation streams

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        clean = name.replace("_fsdp_wrapped_module.", "")
        (no_decay if clean in no_decay_names else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            osd = FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optimizer"])
        optimizer.load_state_dict(osd)
        del ckpt

    ds = HLSChips(args.zarr, args.num_frames)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, persistent_workers=True, prefetch_factor=4)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        n_local = sum(p.numel() for p in model.parameters())
        print(f"world={world} params on rank 0={n_local / 1e6:.1f}M steps/epoch={len(dl)}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for it, x in enumerate(dl):
            lr = lr_for(epoch + it / len(dl), args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            loss, _, _ = model(x, mask_ratio=args.mask_ratio)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            step += 1
            stats[0] += loss.detach().float()
            stats[1] += 1
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} lr {lr:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            save_checkpoint(model, optimizer, epoch, step, os.path.join(args.ckpt_dir, "last.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
