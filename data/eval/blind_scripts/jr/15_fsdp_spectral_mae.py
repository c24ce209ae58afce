"""
Large spectral MAE (ViT-H/14, 12 Sentinel-2 bands) pretrained with FSDP on webdataset shards.

Shards: /lustre/s2_wds/train-{000000..004095}.tar, each sample has "s2.npy" (12, 224, 224) uint16.

    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        15_fsdp_spectral_mae.py --shards "/lustre/s2_wds/train-{000000..004095}.tar" --out /lustre/runs/smae_h14
"""
import argparse
import io
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import BackwardPrefetch, FullStateDictConfig, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from models.mae import mae_vit_huge_patch14

S2_MEAN = np.array([1370, 1184, 1120, 1136, 1263, 1645, 1846, 1762, 1972, 582, 1732, 1247], np.float32)[:, None, None]
S2_STD = np.array([633, 650, 712, 965, 948, 1108, 1258, 1233, 1364, 472, 1310, 1087], np.float32)[:, None, None]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples-per-epoch", type=int, default=2_000_000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--blr", type=float, default=1.5e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--mask-ratio", type=float, default=0.75)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-every", type=int, default=5)
    return p.parse_args()


def decode_sample(sample):
    arr = np.load(io.BytesIO(sample["s2.npy"])).astype(np.float32)
    arr = (arr - S2_MEAN) / S2_STD
    if np.random.rand() < 0.5:
        arr = arr[:, :, ::-1]
    if np.random.rand() < 0.5:
        arr = arr[:, ::-1, :]
    return torch.from_numpy(np.ascontiguousarray(arr))


def make_loader(args, world_size):
    batches_per_rank = args.samples_per_epoch // (args.batch_size * world_size)
    dataset = (
        wds.WebDataset(args.shards, resampled=True, nodesplitter=wds.split_by_node, shardshuffle=True)
        .shuffle(2000)
        .map(decode_sample)
        .batched(args.batch_size, partial=False)
    )
    # every rank runs exactly the same number of steps per epoch
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers, pin_memory=True)
    return loader.with_epoch(batches_per_rank), batches_per_rank


def lr_schedule(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def save_model(model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "epoch": epoch}, path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    np.random.seed(rank)

    model = mae_vit_huge_patch14(img_size=224, in_chans=12, norm_pix_loss=True)
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )
    torch.manual_seed(rank)  # different masks on every rank

    lr = args.blr * args.batch_size * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    loader, steps_per_epoch = make_loader(args, world_size)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world_size}  global batch {args.batch_size * world_size}  lr {lr:.2e}  "
              f"steps/epoch {steps_per_epoch}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(1, device="cuda")
        for imgs in loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule(step, total_steps, warmup_steps, lr)
            imgs = imgs.cuda(non_blocking=True)
            loss, _, _ = model(imgs, mask_ratio=args.mask_ratio)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            running += loss.detach()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        dist.all_reduce(running)
        if rank == 0:
            print(f"== epoch {epoch} mean loss {running.item() / (steps_per_epoch * world_size):.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            save_model(model, optimizer, epoch, os.path.join(args.out, f"checkpoint-{epoch:03d}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
