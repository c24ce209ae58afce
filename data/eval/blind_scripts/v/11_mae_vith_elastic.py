"""MAE pretraining of ViT-H/14 on the unlabeled street-level imagery pool (FSDP, elastic).

Runs on the preemptible A100 pool as a PyTorchJob with an elasticPolicy, so pods come and go:

    elasticPolicy: {rdzvBackend: c10d, minReplicas: 4, maxReplicas: 8, maxRestarts: 20}
    command:
      torchrun --nnodes=4:8 --nproc_per_node=8 --max_restarts=20 \
        --rdzv_backend=c10d --rdzv_endpoint=$(PET_RDZV_ENDPOINT) --rdzv_id=$(PET_RDZV_ID) \
        mae_pretrain_fsdp.py --shards '/mnt/streetview/wds/train-{00000..24575}.tar' \
        --ckpt-dir /mnt/ckpt/mae_vith_sv --total-steps 400000

Checkpoints are written every --save-every steps; after a preemption torchrun restarts all
workers and they pick up from the latest checkpoint.
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import webdataset as wds
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T

import models_mae  # vendored from facebookresearch/mae
from timm.models.vision_transformer import Block


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1.5e-4)
    ap.add_argument("--ref-batch", type=int, default=256)
    ap.add_argument("--mask-ratio", type=float, default=0.75)
    ap.add_argument("--warmup-steps", type=int, default=20000)
    ap.add_argument("--total-steps", type=int, default=400000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


def build_loader(args):
    tf = T.Compose([
        T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    ds = (
        wds.WebDataset(args.shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(2000)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg")
        .map_tuple(tf)
        .batched(args.batch_size, partial=False)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                         persistent_workers=True, prefetch_factor=4)


def lr_at(step, args, peak):
    if step < args.warmup_steps:
        return peak * step / args.warmup_steps
    p = (step - args.warmup_steps) / (args.total_steps - args.warmup_steps)
    return peak * 0.5 * (1.0 + math.cos(math.pi * p))


def save_checkpoint(model, opt, step, ckpt_dir, rank, world):
    path = os.path.join(ckpt_dir, f"step_{step:07d}")
    os.makedirs(path, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(path, f"shard_rank{rank:03d}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest.json"), "w") as f:
            json.dump({"step": step, "dir": path, "world_size": world}, f)


def load_checkpoint(model, opt, ckpt_dir, rank):
    meta_path = os.path.join(ckpt_dir, "latest.json")
    if not os.path.exists(meta_path):
        return 0
    with open(meta_path) as f:
        meta = json.load(f)
    shard = torch.load(os.path.join(meta["dir"], f"shard_rank{rank:03d}.pt"), map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(shard["model"])
    opt.load_state_dict(shard["opt"])
    return meta["step"]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.ckpt_dir, exist_ok=True)

    torch.manual_seed(0)
    model = models_mae.mae_vit_huge_patch14(norm_pix_loss=True)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=local_rank,
        sync_module_states=True,
    )
    eff_batch = args.batch_size * world
    peak_lr = args.base_lr * eff_batch / args.ref_batch
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.05)

    step = load_checkpoint(model, opt, args.ckpt_dir, rank)
    loader = build_loader(args)
    tb = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None
    if rank == 0:
        print(f"[mae] world={world} eff_batch={eff_batch} peak_lr={peak_lr:.2e} start_step={step}", flush=True)

    model.train()
    t0 = time.time()
    data_iter = iter(loader)
    while step < args.total_steps:
        (imgs,) = next(data_iter)
        imgs = imgs.cuda(non_blocking=True)
        lr = lr_at(step, args, peak_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _, _ = model(imgs, mask_ratio=args.mask_ratio)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        model.clip_grad_norm_(3.0)
        opt.step()
        step += 1

        if step % 50 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if tb is not None:
                dt = time.time() - t0
                tb.add_scalar("loss", l.item(), step)
                tb.add_scalar("lr", lr, step)
                tb.add_scalar("img_per_sec", 50 * eff_batch / dt, step)
            t0 = time.time()
        if step % args.save_every == 0:
            save_checkpoint(model, opt, step, args.ckpt_dir, rank, world)

    save_checkpoint(model, opt, step, args.ckpt_dir, rank, world)
    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
