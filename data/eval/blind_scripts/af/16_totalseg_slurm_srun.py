"""
TotalSegmentator (v2, 1.5 mm) multi-class training with a DynUNet on the cluster.

Job script (jobs/totalseg.sbatch):
    #!/bin/bash
    #SBATCH --job-name=totalseg
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=12
    #SBATCH --time=72:00:00
    #SBATCH --output=logs/%x_%j.out
    module load cuda/12.1
    source ~/venvs/monai/bin/activate
    export MASTER_PORT=29617
    srun python 16_totalseg_slurm_srun.py --data /project/totalseg/v2 --out /project/exp/totalseg_dynunet
"""
import argparse
import datetime
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, DistributedSampler, load_decathlon_datalist
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import DynUNet
from monai.transforms import (Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, RandCropByLabelClassesd,
                              RandFlipd, RandScaleIntensityd, RandShiftIntensityd, ScaleIntensityRanged,
                              SpatialPadd)

N_CLASSES = 118
PATCH = (128, 128, 128)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--datalist", default="datalist_fold0.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=20)
    ap.add_argument("--cache_rate", type=float, default=0.25)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def setup_distributed():
    if "SLURM_JOB_NODELIST" in os.environ and "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", "29500")
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=60))
    return rank, world_size, local_rank


def get_loaders(args, rank):
    keys = ["image", "label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys),
           ScaleIntensityRanged(keys="image", a_min=-1024, a_max=1500, b_min=0.0, b_max=1.0, clip=True),
           EnsureTyped(keys=keys, track_meta=False)]
    train_tf = Compose(pre + [
        SpatialPadd(keys=keys, spatial_size=PATCH),
        RandCropByLabelClassesd(keys=keys, label_key="label", spatial_size=PATCH, num_classes=N_CLASSES,
                                num_samples=1, warn=False),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=2),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.3),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.3),
    ])
    dl = os.path.join(args.data, args.datalist)
    train_files = load_decathlon_datalist(dl, True, "training", base_dir=args.data)
    val_files = load_decathlon_datalist(dl, True, "validation", base_dir=args.data)
    train_ds = CacheDataset(train_files, train_tf, cache_rate=args.cache_rate, num_workers=12, progress=rank == 0)
    val_ds = CacheDataset(val_files, Compose(pre), cache_rate=0.0)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=10,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)
    return train_loader, val_loader, train_sampler


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world size {world_size}, master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)

    train_loader, val_loader, train_sampler = get_loaders(args, rank)
    kernels = [[3, 3, 3]] * 6
    strides = [[1, 1, 1]] + [[2, 2, 2]] * 5
    net = DynUNet(3, 1, N_CLASSES, kernels, strides, strides[1:], filters=[32, 64, 128, 256, 320, 320],
                  norm_name="instance", res_block=True).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best = 0, 0.0
    ckpt_file = os.path.join(args.out, "latest.pt")
    if args.resume and os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        net.load_state_dict(ck["net"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)

    for epoch in range(start_epoch, args.epochs):
        lr = args.lr * (1 - epoch / args.epochs) ** 0.9
        for g in optimizer.param_groups:
            g["lr"] = lr
        train_sampler.set_epoch(epoch)
        model.train()
        t0, acc = time.time(), torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(optimizer)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} lr {lr:.5f} {time.time() - t0:.0f}s",
                  flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            inter = torch.zeros(N_CLASSES - 1, device=device)
            union = torch.zeros(N_CLASSES - 1, device=device)
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].to(device), batch["label"].to(device).long()
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(x, PATCH, 2, net, overlap=0.25).argmax(1, keepdim=True)
                    for c in range(1, N_CLASSES):
                        p, t = pred == c, y == c
                        inter[c - 1] += (p & t).sum()
                        union[c - 1] += p.sum() + t.sum()
            dist.all_reduce(inter)
            dist.all_reduce(union)
            present = union > 0
            dice = (2 * inter[present] / union[present]).mean().item()
            if rank == 0:
                print(f"  val global dice (mean over {int(present.sum())} classes) {dice:.4f}", flush=True)
                if dice > best:
                    best = dice
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
                with open(os.path.join(args.out, "val_log.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "dice": dice}) + "\n")
            best = max(best, dice)
        if rank == 0:
            torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_file)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
