#!/usr/bin/env python
"""ViT-B/16 supervised training with automatic requeue.

jobs/vit.sbatch:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=10
    #SBATCH --time=12:00:00
    #SBATCH --signal=USR1@180
    #SBATCH --requeue

    srun python train_vit.py --config configs/vit_b16.yaml

MASTER_ADDR / MASTER_PORT are worked out below from the job's node list, so
the same script works from an interactive salloc as well.
"""
import argparse
import datetime
import os
import signal
import subprocess
import time

import yaml
import torch
import torch.distributed as dist
import torch.nn as nn
import timm
from timm.data import create_transform, Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

_STOP = False


def _on_usr1(signum, frame):
    global _STOP
    _STOP = True


def first_host():
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    out = subprocess.check_output(["scontrol", "show", "hostnames", nodelist])
    return out.decode().split()[0]


def init_dist():
    os.environ.setdefault("MASTER_ADDR", first_host())
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=20))
    return rank, world, local


def load_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = a.resume
    return cfg


def make_data(cfg, rank, world):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic")
    train_ds = ImageFolder(os.path.join(cfg["data_root"], "train"), train_tf)
    val_ds = ImageFolder(os.path.join(cfg["data_root"], "val"), val_tf)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                 seed=cfg.get("seed", 0), drop_last=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", "8"))
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler,
                          num_workers=nw, pin_memory=True, drop_last=True,
                          persistent_workers=True, prefetch_factor=4)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(Subset(val_ds, val_idx), batch_size=256, num_workers=nw,
                        pin_memory=True)
    return train_dl, val_dl, sampler


@torch.no_grad()
def validate(net, loader):
    net.eval()
    acc = torch.zeros(2, device="cuda")
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        acc[0] += (logits.argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def stop_requested():
    flag = torch.tensor([1.0 if _STOP else 0.0], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def main():
    cfg = load_cfg()
    rank, world, local = init_dist()
    signal.signal(signal.SIGUSR1, _on_usr1)
    torch.manual_seed(cfg.get("seed", 0) + rank)

    out_dir = os.path.join(cfg["out_root"], cfg["name"])
    ckpt_file = os.path.join(out_dir, "checkpoint.pt")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_dl, val_dl, sampler = make_data(cfg, rank, world)

    model = timm.create_model("vit_base_patch16_224", num_classes=1000,
                              drop_path_rate=0.1).cuda()
    model = DDP(model, device_ids=[local], gradient_as_bucket_view=True)

    global_bs = cfg["batch_per_gpu"] * world
    lr = cfg["blr"] * global_bs / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05,
                                  betas=(0.9, 0.999))
    steps_per_epoch = len(train_dl)
    total_steps = cfg["epochs"] * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps,
                                                pct_start=cfg["warmup_epochs"] / cfg["epochs"],
                                                anneal_strategy="cos")
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    epoch, step = 0, 0
    resume = cfg["resume"] or (ckpt_file if os.path.exists(ckpt_file) else None)
    if resume:
        state = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        epoch, step = state["epoch"], state["step"]
        if rank == 0:
            print(f"[resume] epoch {epoch} step {step}", flush=True)

    def checkpoint(next_epoch, next_step):
        if rank == 0:
            tmp = ckpt_file + ".part"
            torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": next_epoch,
                        "step": next_step, "cfg": cfg}, tmp)
            os.replace(tmp, ckpt_file)
        dist.barrier()

    preempted = False
    while epoch < cfg["epochs"] and not preempted:
        sampler.set_epoch(epoch)
        model.train()
        skip = step - epoch * steps_per_epoch
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            if i < skip:
                continue
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                if rank == 0:
                    ips = 50 * global_bs / (time.time() - t0)
                    print(f"ep {epoch} step {step} loss {loss.item():.4f} {ips:.0f} img/s",
                          flush=True)
                    t0 = time.time()
                if stop_requested():
                    preempted = True
                    break
        if preempted:
            break
        epoch += 1
        acc = validate(model.module, val_dl)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc * 100:.2f}", flush=True)
        checkpoint(epoch, step)

    if preempted:
        checkpoint(epoch, step)
        if rank == 0:
            print("caught USR1, checkpoint written, requeueing", flush=True)
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
