"""Elastic ViT-L/16 training with FSDP and torch.distributed.checkpoint (DCP).

The node count may change between restarts:
    torchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=20 \
        --rdzv-id=vitl --rdzv-backend=c10d --rdzv-endpoint=$RDZV_HOST:29400 \
        18_vit_large_fsdp_dcp_elastic.py --data /fsx/imagenet --ckpt /fsx/ckpt/vitl

DCP stores the sharded state with global metadata, so a checkpoint written by
16 ranks can be loaded (resharded) by 8 or 32 ranks. The global batch is fixed,
so the per-rank batch is derived from the world size of the current round.
"""
import argparse
import functools
import json
import math
import os
import signal
import time

import timm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

_sigterm = False


def _handler(signum, frame):
    global _sigterm
    _sigterm = True


class TrainState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class OffsetSampler(DistributedSampler):
    """DistributedSampler that drops the first `offset` samples of this rank's share."""

    offset = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.offset:])

    def __len__(self):
        return self.num_samples - self.offset


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1.6e-3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=20)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = cli()
    signal.signal(signal.SIGTERM, _handler)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.global_batch % world == 0, f"global batch {args.global_batch} vs world {world}"
    per_rank = args.global_batch // world

    normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    sampler = OffsetSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    steps_per_epoch = len(train_set) // args.global_batch
    total_steps = args.epochs * steps_per_epoch

    torch.manual_seed(args.seed)
    model = timm.create_model("vit_large_patch16_224", num_classes=1000, drop_path_rate=0.2)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 device_id=local_rank, use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warm = args.warmup_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total_steps - warm))))

    step = 0
    latest = os.path.join(args.ckpt, "latest.json")
    if os.path.exists(latest):
        with open(latest) as f:
            meta = json.load(f)
        dcp.load({"train": TrainState(model, optimizer)}, checkpoint_id=meta["path"])
        step = meta["step"]
        scheduler.load_state_dict(meta["scheduler"])
        if rank == 0:
            print(f"resumed {meta['path']} (saved by {meta['world']} ranks) with {world} ranks", flush=True)
    torch.manual_seed(args.seed + 100003 * step + rank)  # per-rank stream, independent of world size

    def save():
        path = os.path.join(args.ckpt, f"step_{step:07d}")
        dcp.save({"train": TrainState(model, optimizer)}, checkpoint_id=path)
        if rank == 0:
            tmp = latest + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"path": path, "step": step, "world": world, "scheduler": scheduler.state_dict()}, f)
            os.replace(tmp, latest)
        dist.barrier()

    model.train()
    stop = torch.zeros(1, device="cuda")
    while step < total_steps:
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        sampler.offset = step_in_epoch * per_rank  # global samples consumed / world
        loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, num_workers=10,
                            pin_memory=True, drop_last=True)
        t0 = time.time()
        for images, labels in loader:
            images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                avg = loss.detach().float()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total_steps} loss {avg.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{50 * args.global_batch / (time.time() - t0):.0f} img/s (world {world})", flush=True)
                    t0 = time.time()

            stop[0] = float(_sigterm)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or step % args.save_every == 0 or step == total_steps:
                save()
            if stop.item() or step % steps_per_epoch == 0 or step == total_steps:
                break
        if stop.item():
            if rank == 0:
                print(f"SIGTERM: saved step {step}, leaving so torchrun can re-rendezvous", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
