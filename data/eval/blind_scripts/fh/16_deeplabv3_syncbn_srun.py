#!/usr/bin/env python
"""DeepLabV3-ResNet101 on ADE20K, 2 nodes x 4 GPUs, 4 crops per GPU.

    #SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8
    #SBATCH --time=06:00:00 --requeue
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=$((29000 + SLURM_JOB_ID % 1000))
    srun python deeplab_ade.py --root /scratch/shared/ADEChallengeData2016 \
        --work /project/seg/deeplab_r101

The run watches the job's wall clock and stops cleanly a few minutes before
the time limit; the requeued job continues from work/last.pth.
"""
import argparse
import os
import random
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.segmentation import deeplabv3_resnet101
from torchvision.transforms import functional as TF

NUM_CLASSES = 150


class ADE20K(Dataset):
    def __init__(self, root, split, crop=512, train=True):
        sub = "training" if split == "train" else "validation"
        self.img_dir = os.path.join(root, "images", sub)
        self.ann_dir = os.path.join(root, "annotations", sub)
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        ann = Image.open(os.path.join(self.ann_dir, self.names[i] + ".png"))
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            img = img.resize((int(w * s), int(h * s)), Image.BILINEAR)
            ann = ann.resize((int(w * s), int(h * s)), Image.NEAREST)
            pw, ph = max(self.crop - img.width, 0), max(self.crop - img.height, 0)
            img = TF.pad(img, [0, 0, pw, ph], fill=0)
            ann = TF.pad(ann, [0, 0, pw, ph], fill=0)
            x = random.randint(0, img.width - self.crop)
            y = random.randint(0, img.height - self.crop)
            img = img.crop((x, y, x + self.crop, y + self.crop))
            ann = ann.crop((x, y, x + self.crop, y + self.crop))
            if random.random() < 0.5:
                img, ann = TF.hflip(img), TF.hflip(ann)
        t = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        # ADE labels: 0 = other/ignore, 1..150 = classes -> shift to 0..149, ignore 255
        m = torch.from_numpy(np.array(ann, dtype=np.int64)) - 1
        m[m < 0] = 255
        return t, m


def job_seconds_left():
    end = os.environ.get("SLURM_JOB_END_TIME")
    return float("inf") if end is None else int(end) - time.time()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--backbone-weights", default="/project/seg/pretrained/resnet101_imagenet1k_v2.pth")
    ap.add_argument("--iters", type=int, default=160_000)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--stop-margin", type=int, default=600, help="seconds before time limit")
    args = ap.parse_args()

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)

    train_ds = ADE20K(args.root, "train")
    val_ds = ADE20K(args.root, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=0)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=7, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=4)

    torch.manual_seed(0)   # identical head initialisation on every rank
    model = deeplabv3_resnet101(weights=None, weights_backbone=None,
                                num_classes=NUM_CLASSES, aux_loss=True)
    # compute nodes have no internet: ImageNet weights are kept on the project disk
    bb = torch.load(args.backbone_weights, map_location="cpu")
    missing, _ = model.backbone.load_state_dict(bb, strict=False)
    assert not missing, missing
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    backbone = [p for n, p in model.named_parameters() if "backbone" in n]
    heads = [p for n, p in model.named_parameters() if "backbone" not in n]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr},
                           {"params": heads, "lr": args.lr * 10}],
                          lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.iters, power=0.9)
    crit = nn.CrossEntropyLoss(ignore_index=255)

    last = os.path.join(args.work, "last.pth")
    it = 0
    if os.path.exists(last):
        st = torch.load(last, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.load_state_dict(st["model"])          # saved from the DDP wrapper
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        it = st["iter"]

    writer = None
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.work, "tb"), purge_step=it)

    def checkpoint():
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "iter": it}, last + ".tmp")
            os.replace(last + ".tmp", last)
        dist.barrier()

    epoch = it // len(train_dl)
    out_of_time = False
    model.train()
    while it < args.iters and not out_of_time:
        sampler.set_epoch(epoch)
        for img, mask in train_dl:
            img, mask = img.cuda(non_blocking=True), mask.cuda(non_blocking=True)
            out = model(img)
            loss = crit(out["out"], mask) + 0.4 * crit(out["aux"], mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if it % 20 == 0:
                low = torch.tensor([job_seconds_left() < args.stop_margin], device="cuda",
                                   dtype=torch.int32)
                dist.all_reduce(low, op=dist.ReduceOp.MAX)
                if writer is not None:
                    writer.add_scalar("train/loss", loss.item(), it)
                if low.item():
                    out_of_time = True
                    break
            if it % 4000 == 0:
                checkpoint()
            if it >= args.iters:
                break
        epoch += 1

    checkpoint()
    if out_of_time:
        if rank == 0:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
        dist.destroy_process_group()
        return

    # single-scale evaluation, every rank on its own slice of the val set
    net = model.module.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        for img, mask in val_dl:
            img, mask = img.cuda(), mask.cuda()
            pred = net(img)["out"].argmax(1)
            k = mask != 255
            hist += torch.bincount(NUM_CLASSES * mask[k] + pred[k],
                                   minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(hist)
    if rank == 0:
        h = hist.double()
        iou = h.diag() / (h.sum(0) + h.sum(1) - h.diag())
        miou = torch.nanmean(iou).item()
        pixacc = (h.diag().sum() / h.sum()).item()
        print(f"val mIoU {miou * 100:.2f}  pixAcc {pixacc * 100:.2f}", flush=True)
        writer.add_scalar("val/mIoU", miou, it)
        writer.close()
        torch.save(model.module.state_dict(), os.path.join(args.work, "final_weights.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
