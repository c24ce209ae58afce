#!/usr/bin/env python
"""ConvNeXt-T on iNaturalist-2021 (mini), torchrun under srun.

    #!/bin/bash
    #SBATCH --nodes=3
    #SBATCH --ntasks-per-node=1          # one torchrun agent per node
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=64
    #SBATCH --time=2-00:00:00
    #SBATCH --requeue

    head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)
    srun torchrun \
        --nnodes "$SLURM_NNODES" --nproc_per_node 4 \
        --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_ip:29400" \
        convnext_inat.py --archive /proj/inat/inat2021_mini.tar --out /proj/inat/runs

The global batch is kept at 4096 whatever the number of nodes: the number of
gradient-accumulation steps follows from the world size.
"""
import argparse
import contextlib
import datetime
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import timm
import wandb
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--archive", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args()


def unpack_to_node_scratch(archive, local_rank):
    """Local rank 0 of each node extracts the archive once; the others wait."""
    dest = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "inat_mini")
    done = os.path.join(dest, ".unpacked")
    if local_rank == 0 and not os.path.exists(done):
        os.makedirs(dest, exist_ok=True)
        subprocess.run(["tar", "-xf", archive, "-C", dest, "--strip-components=1"], check=True)
        open(done, "w").close()
    dist.barrier()
    assert os.path.exists(done), f"{dest} not staged on {os.uname().nodename}"
    return dest


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))

    root = unpack_to_node_scratch(args.archive, local_rank)

    accum = args.global_batch // (args.micro_batch * world)
    assert accum >= 1 and accum * args.micro_batch * world == args.global_batch, \
        f"global batch {args.global_batch} not reachable with {world} GPUs"

    train_ds = ImageFolder(os.path.join(root, "train"),
                           create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1"))
    val_ds = ImageFolder(os.path.join(root, "val"), create_transform(224, is_training=False))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=0)
    train_dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, num_workers=14,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 256, num_workers=14)

    model = timm.create_model("convnext_tiny", num_classes=len(train_ds.classes),
                              drop_path_rate=0.1).cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)   # no-op for LayerNorm models
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = len(train_dl) // accum
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=args.warmup * steps_per_epoch),
        torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, (args.epochs - args.warmup) * steps_per_epoch)],
        milestones=[args.warmup * steps_per_epoch])
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    run_dir = os.path.join(args.out, f"convnext_t_{os.environ['SLURM_JOB_ID']}")
    ckpt_file = os.path.join(run_dir, "last.pt")
    start = 0
    if os.path.exists(ckpt_file):
        s = torch.load(ckpt_file, map_location=f"cuda:{local_rank}")
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        sched.load_state_dict(s["sched"])
        start = s["epoch"] + 1

    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        wandb.init(project="inat-convnext", id=os.environ["SLURM_JOB_ID"], resume="allow",
                   config=vars(args) | {"world_size": world, "accum": accum})

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            if i >= steps_per_epoch * accum:
                break
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            boundary = (i + 1) % accum == 0
            ctx = ddp.no_sync() if not boundary else contextlib.nullcontext()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(ddp(x), y) / accum
                loss.backward()
            if boundary:
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                if rank == 0 and (i // accum) % 50 == 0:
                    wandb.log({"loss": loss.item() * accum, "lr": sched.get_last_lr()[0]})

        model.eval()
        hits = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                hits[0] += (model(x).argmax(-1) == y).sum()
                hits[1] += len(y)
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()

        if rank == 0:
            wandb.log({"epoch": epoch, "val/top1": acc, "epoch_time": time.time() - t0})
            print(f"epoch {epoch} top1 {acc:.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
