"""RAFT "sintel" stage fine-tuning on the C+T+S+K+H mixture, multi-GPU.

    torchrun --nproc_per_node=4 03_raft_mixed_stage.py --stage sintel \
        --restore_ckpt checkpoints/raft-things.pth --num_steps 100000 --batch_size 2
"""
import argparse
import json
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from core.raft import RAFT
from core import datasets
from core.utils.utils import InputPadder

MAX_FLOW = 400


def is_main():
    return dist.get_rank() == 0


def build_train_set(args):
    aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
    things = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
    sintel_clean = datasets.MpiSintel(aug, split="training", dstype="clean")
    sintel_final = datasets.MpiSintel(aug, split="training", dstype="final")
    kitti = datasets.KITTI({"crop_size": args.image_size, "min_scale": -0.3,
                            "max_scale": 0.5, "do_flip": True})
    hd1k = datasets.HD1K({"crop_size": args.image_size, "min_scale": -0.5,
                          "max_scale": 0.2, "do_flip": True})
    # same weighting as the RAFT paper; every sample is cropped to image_size so
    # the different source resolutions batch together
    return ConcatDataset([100 * sintel_clean, 100 * sintel_final, 200 * kitti, 5 * hd1k, things])


def sequence_loss(flow_preds, flow_gt, valid, gamma):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    loss = flow_gt.new_zeros(())
    for i, pred in enumerate(flow_preds):
        w = gamma ** (n - i - 1)
        loss = loss + w * (valid[:, None] * (pred - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return loss, epe.detach()


@torch.no_grad()
def validate_sintel(net, device, rank, world, iters=32):
    """Each rank evaluates a strided slice, then sums are reduced across ranks."""
    net.eval()
    results = {}
    for dstype in ("clean", "final"):
        full = datasets.MpiSintel(split="training", dstype=dstype)
        shard = Subset(full, range(rank, len(full), world))
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # epe, 1px, 3px, 5px
        count = torch.zeros(1, dtype=torch.float64, device=device)
        for img1, img2, flow_gt, _ in shard:
            img1, img2 = img1[None].to(device), img2[None].to(device)
            padder = InputPadder(img1.shape)
            img1, img2 = padder.pad(img1, img2)
            _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
            flow = padder.unpad(flow_pr[0])
            epe = torch.sum((flow - flow_gt.to(device)) ** 2, dim=0).sqrt().view(-1)
            sums += torch.stack([epe.sum(), (epe < 1).sum(), (epe < 3).sum(), (epe < 5).sum()]).double()
            count += epe.numel()
        dist.all_reduce(sums)
        dist.all_reduce(count)
        m = (sums / count).tolist()
        results[dstype] = {"epe": m[0], "1px": m[1], "3px": m[2], "5px": m[3]}
    net.train()
    return results


def load_pretrained(model, path):
    state = torch.load(path, map_location="cpu")
    if "model" in state:
        state = state["model"]
    # the released checkpoints come from nn.DataParallel
    state = OrderedDict((k[7:] if k.startswith("module.") else k, v) for k, v in state.items())
    model.load_state_dict(state, strict=True)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="raft-sintel")
    p.add_argument("--stage", default="sintel")
    p.add_argument("--restore_ckpt", default=None)
    p.add_argument("--resume", default=None, help="training state written by this script")
    p.add_argument("--output", default="checkpoints")
    p.add_argument("--small", action="store_true")
    p.add_argument("--lr", type=float, default=1.25e-4)
    p.add_argument("--num_steps", type=int, default=100000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--image_size", type=int, nargs=2, default=[368, 768])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--gamma", type=float, default=0.85)
    p.add_argument("--wdecay", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--alternate_corr", action="store_true")
    p.add_argument("--val_freq", type=int, default=10000)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank + 7)
    torch.manual_seed(rank + 7)

    model = RAFT(args)
    if args.restore_ckpt is not None:
        load_pretrained(model, args.restore_ckpt)
    model.to(device)
    model.freeze_bn()  # BN layers stay frozen after the chairs stage
    model = DDP(model, device_ids=[local_rank])

    train_set = build_train_set(args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=2024, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                                    pct_start=0.05, cycle_momentum=False,
                                                    anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    step, epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step, epoch = ckpt["step"], ckpt["epoch"]

    if is_main():
        os.makedirs(args.output, exist_ok=True)
        print(f"{len(train_set)} training pairs, {world} GPUs x {args.batch_size}", flush=True)

    log_sums = torch.zeros(3, device=device)
    tic = time.time()
    model.train()
    model.module.freeze_bn()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2 = img1.to(device, non_blocking=True), img2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            if args.stage != "chairs":
                stdv = np.random.uniform(0.0, 5.0)
                img1 = (img1 + stdv * torch.randn_like(img1)).clamp(0.0, 255.0)
                img2 = (img2 + stdv * torch.randn_like(img2)).clamp(0.0, 255.0)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(img1, img2, iters=args.iters)
            loss, epe = sequence_loss([p.float() for p in preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            log_sums += torch.stack([loss.detach(), epe.sum(), torch.tensor(float(epe.numel()), device=device)])
            if step % 200 == 0:
                dist.all_reduce(log_sums)
                if is_main():
                    print(f"[{step:6d}] loss {log_sums[0].item() / (200 * world):.4f} "
                          f"epe {log_sums[1].item() / max(log_sums[2].item(), 1):.3f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
                log_sums.zero_()
                tic = time.time()

            if step % args.val_freq == 0 or step == args.num_steps:
                res = validate_sintel(model.module, device, rank, world)
                if is_main():
                    print(json.dumps({"step": step, **res}), flush=True)
                    torch.save({"model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(),
                                "scaler": scaler.state_dict(),
                                "step": step, "epoch": epoch},
                               os.path.join(args.output, f"{args.name}_{step}.pth"))
                model.train()
                model.module.freeze_bn()
                dist.barrier()
            if step >= args.num_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
