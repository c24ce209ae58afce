"""Fine-tune RAFT on KITTI-2015 flow (sparse LiDAR-derived ground truth).

    torchrun --nproc_per_node=4 finetune_kitti.py --restore_ckpt models/raft-sintel.pth \
        --image_size 288 960 --batch_size 8 --num_steps 50000
"""
import argparse
import os
import os.path as osp
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from core.raft import RAFT
from core.utils import frame_utils
from core.utils.augmentor import SparseFlowAugmentor
from core.utils.utils import InputPadder

cv2.setNumThreads(0)


class KITTIFlow(Dataset):
    def __init__(self, root, split="training", aug_params=None, indices=None):
        self.augmentor = SparseFlowAugmentor(**aug_params) if aug_params is not None else None
        images1 = sorted(glob(osp.join(root, split, "image_2/*_10.png")))
        images2 = sorted(glob(osp.join(root, split, "image_2/*_11.png")))
        flows = sorted(glob(osp.join(root, split, "flow_occ/*_10.png")))
        idx = range(len(images1)) if indices is None else indices
        self.samples = [(images1[i], images2[i], flows[i]) for i in idx]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        p1, p2, pf = self.samples[index]
        flow, valid = frame_utils.readFlowKITTI(pf)
        img1 = np.array(frame_utils.read_gen(p1)).astype(np.uint8)[..., :3]
        img2 = np.array(frame_utils.read_gen(p2)).astype(np.uint8)[..., :3]
        if self.augmentor is not None:
            img1, img2, flow, valid = self.augmentor(img1, img2, flow, valid)
        img1 = torch.from_numpy(img1).permute(2, 0, 1).float()
        img2 = torch.from_numpy(img2).permute(2, 0, 1).float()
        flow = torch.from_numpy(flow).permute(2, 0, 1).float()
        valid = torch.from_numpy(valid).float()
        return img1, img2, flow, valid


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.85, max_flow=400):
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).sum() / (2 * valid.sum())
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    return flow_loss, epe[valid]


@torch.no_grad()
def validate_kitti(model, dataset, device, rank, world, iters=24):
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for i in range(rank, len(dataset), world):
        image1, image2, flow_gt, valid_gt = dataset[i]
        image1, image2 = image1[None].to(device), image2[None].to(device)
        padder = InputPadder(image1.shape, mode="kitti")
        image1, image2 = padder.pad(image1, image2)
        _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        flow = padder.unpad(flow_pr[0])
        flow_gt, valid_gt = flow_gt.to(device), valid_gt.to(device)
        epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
        mag = torch.sum(flow_gt ** 2, dim=0).sqrt()
        val = valid_gt >= 0.5
        out = ((epe > 3.0) & ((epe / mag) > 0.05)).double()
        sums[0] += epe[val].mean().double()
        sums[1] += out[val].sum()
        sums[2] += val.sum()
    dist.all_reduce(sums)
    model.train()
    model.freeze_bn()
    return {"kitti-epe": sums[0].item() / len(dataset), "kitti-f1": 100.0 * sums[1].item() / sums[2].item()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-kitti")
    parser.add_argument("--root", default="datasets/KITTI")
    parser.add_argument("--restore_ckpt", required=True)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--num_steps", type=int, default=50000)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, nargs=2, default=[288, 960])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=1e-5)
    parser.add_argument("--gamma", type=float, default=0.85)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--num_val", type=int, default=40, help="hold out the last N training pairs")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)

    aug = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": False}
    train_set = KITTIFlow(args.root, aug_params=aug, indices=range(0, 200 - args.num_val))
    val_set = KITTIFlow(args.root, indices=range(200 - args.num_val, 200))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = RAFT(args)
    state = torch.load(args.restore_ckpt, map_location="cpu")
    model.load_state_dict({k.replace("module.", "", 1): v for k, v in state.items()})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model.train()
    model.module.freeze_bn()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    os.makedirs("checkpoints", exist_ok=True)

    step, epoch = 0, 0
    log = torch.zeros(3, device=device)
    t0 = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            if valid.sum() < 1:
                # the random crop fell completely outside the LiDAR footprint
                continue

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(image1, image2, iters=args.iters)
            loss, epe = sequence_loss(preds, flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            log[0] += loss.detach()
            log[1] += epe.sum()
            log[2] += epe.numel()
            if step % 100 == 0:
                dist.all_reduce(log)
                if rank == 0:
                    print("step %6d  lr %.2e  loss %.3f  epe %.3f  %.2fs/it" % (
                        step, scheduler.get_last_lr()[0], log[0].item() / (100 * world),
                        log[1].item() / max(log[2].item(), 1), (time.time() - t0) / 100))
                log.zero_()
                t0 = time.time()

            if step % 5000 == 0:
                res = validate_kitti(model.module, val_set, device, rank, world)
                if rank == 0:
                    print("validation", res)
                    torch.save(model.module.state_dict(), "checkpoints/%d_%s.pth" % (step, args.name))
                dist.barrier()
            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), "checkpoints/%s.pth" % args.name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
