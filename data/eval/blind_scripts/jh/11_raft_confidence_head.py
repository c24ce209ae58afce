"""RAFT with an auxiliary per-pixel confidence head (predicts whether the final
flow is an inlier, EPE < 3px). Stage 1 trains flow only, stage 2 switches the
confidence loss on.

    torchrun --nproc_per_node=4 11_raft_confidence_head.py --stage things --conf_weight 0.0
    torchrun --nproc_per_node=4 11_raft_confidence_head.py --stage sintel --conf_weight 0.1 \
        --restore_ckpt out/raftconf_things.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.raft import RAFT


def backwarp(img, flow):
    b, _, h, w = img.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=img.device), torch.arange(w, device=img.device), indexing="ij")
    gx = (xs[None] + flow[:, 0]) / (w - 1) * 2 - 1
    gy = (ys[None] + flow[:, 1]) / (h - 1) * 2 - 1
    return F.grid_sample(img, torch.stack([gx, gy], -1), align_corners=True, padding_mode="border")


class ConfidenceHead(nn.Module):
    def __init__(self, ch=32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3 + 3 + 2 + 1, ch, 3, padding=1), nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(ch, ch, 3, padding=1), nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(ch, ch, 3, padding=2, dilation=2), nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(ch, 1, 3, padding=1))

    def forward(self, img1, img2, flow):
        img1 = img1 / 255.0
        warped = backwarp(img2 / 255.0, flow)
        photo = (img1 - warped).abs().mean(1, keepdim=True)
        return self.net(torch.cat([img1, warped, flow / 20.0, photo], 1))


class RAFTConf(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.raft = RAFT(args)
        self.conf = ConfidenceHead()

    def freeze_bn(self):
        self.raft.freeze_bn()

    def forward(self, img1, img2, iters=12, test_mode=False):
        if test_mode:
            _, flow_up = self.raft(img1, img2, iters=iters, test_mode=True)
            return flow_up, torch.sigmoid(self.conf(img1, img2, flow_up))
        preds = self.raft(img1, img2, iters=iters)
        conf_logit = self.conf(img1, img2, preds[-1].detach())
        return preds, conf_logit


def losses(preds, conf_logit, gt, valid, gamma, max_flow=400.0):
    n = len(preds)
    mag = torch.sum(gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    flow_loss = 0.0
    for i, p in enumerate(preds):
        flow_loss = flow_loss + gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean()
    epe = torch.sum((preds[-1].detach() - gt) ** 2, dim=1).sqrt()
    target = (epe < 3.0).float()
    conf_loss = F.binary_cross_entropy_with_logits(conf_logit[:, 0][valid], target[valid])
    return flow_loss, conf_loss, epe[valid]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", default="things")
    ap.add_argument("--name", default="raftconf")
    ap.add_argument("--restore_ckpt", default=None)
    ap.add_argument("--out", default="out")
    ap.add_argument("--conf_weight", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1.25e-4)
    ap.add_argument("--num_steps", type=int, default=100000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--image_size", type=int, nargs=2, default=[400, 720])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--alternate_corr", action="store_true")
    ap.add_argument("--mixed_precision", action="store_true")
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    np.random.seed(rank)
    torch.manual_seed(rank)

    model = RAFTConf(args)
    if args.restore_ckpt:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict(sd)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    if args.stage == "things":
        aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        train_set = (datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
                     + datasets.FlyingThings3D(aug, dstype="frames_finalpass"))
    else:
        aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        train_set = (100 * datasets.MpiSintel(aug, split="training", dstype="clean")
                     + 100 * datasets.MpiSintel(aug, split="training", dstype="final")
                     + datasets.FlyingThings3D(aug, dstype="frames_cleanpass"))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    model.train()
    model.module.freeze_bn()
    acc = torch.zeros(4, device=device)
    t0 = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2, flow, valid = (x.to(device, non_blocking=True) for x in (img1, img2, flow, valid))
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds, conf_logit = model(img1, img2, iters=args.iters)
            flow_loss, conf_loss, epe = losses([p.float() for p in preds], conf_logit.float(), flow, valid, args.gamma)
            loss = flow_loss
            if args.conf_weight > 0:
                loss = loss + args.conf_weight * conf_loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            acc += torch.stack([flow_loss.detach(), conf_loss.detach(), epe.sum(),
                                torch.tensor(float(epe.numel()), device=device)])
            if step % 100 == 0:
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"[{step}] flow {acc[0].item() / (100 * world):.4f} conf {acc[1].item() / (100 * world):.4f} "
                          f"epe {acc[2].item() / max(acc[3].item(), 1):.3f} ({time.time() - t0:.0f}s)", flush=True)
                acc.zero_()
                t0 = time.time()
            if step % 10000 == 0 and rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"{args.name}_{args.stage}_{step}.pth"))
            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, f"{args.name}_{args.stage}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
