"""Train RAFT on FlyingChairs with DistributedDataParallel.

Launch:
    torchrun --nproc_per_node=8 01_raft_chairs_train.py --data_root /datasets/FlyingChairs_release
"""
import argparse
import os
import os.path as osp
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from core.raft import RAFT  # repository model (princeton-vl/RAFT layout)

MAX_FLOW = 400
TAG_FLOAT = 202021.25


def read_flo(path):
    with open(path, "rb") as f:
        magic = np.fromfile(f, np.float32, count=1)
        if magic != TAG_FLOAT:
            raise ValueError(f"bad .flo header in {path}")
        w = int(np.fromfile(f, np.int32, count=1))
        h = int(np.fromfile(f, np.int32, count=1))
        data = np.fromfile(f, np.float32, count=2 * w * h)
    return data.reshape(h, w, 2)


class FlyingChairs(Dataset):
    def __init__(self, root, split="training", crop_size=(368, 496)):
        images = sorted(glob(osp.join(root, "data", "*.ppm")))
        flows = sorted(glob(osp.join(root, "data", "*.flo")))
        assert len(images) // 2 == len(flows)
        split_ids = np.loadtxt(osp.join(root, "chairs_split.txt"), dtype=np.int32)
        want = 1 if split == "training" else 2
        self.samples = []
        for i, flo in enumerate(flows):
            if split_ids[i] == want:
                self.samples.append((images[2 * i], images[2 * i + 1], flo))
        self.crop_size = crop_size
        self.augment = split == "training"

    def __len__(self):
        return len(self.samples)

    def _random_crop(self, img1, img2, flow):
        ch, cw = self.crop_size
        h, w = flow.shape[:2]
        y0 = np.random.randint(0, h - ch + 1)
        x0 = np.random.randint(0, w - cw + 1)
        sl = (slice(y0, y0 + ch), slice(x0, x0 + cw))
        return img1[sl], img2[sl], flow[sl]

    def __getitem__(self, idx):
        p1, p2, pf = self.samples[idx]
        img1 = np.asarray(Image.open(p1).convert("RGB"), dtype=np.float32)
        img2 = np.asarray(Image.open(p2).convert("RGB"), dtype=np.float32)
        flow = read_flo(pf)
        if self.augment:
            if np.random.rand() < 0.5:  # horizontal flip
                img1, img2 = img1[:, ::-1], img2[:, ::-1]
                flow = flow[:, ::-1] * np.array([-1.0, 1.0], dtype=np.float32)
            img1, img2, flow = self._random_crop(img1, img2, flow)
        img1 = torch.from_numpy(np.ascontiguousarray(img1)).permute(2, 0, 1)
        img2 = torch.from_numpy(np.ascontiguousarray(img2)).permute(2, 0, 1)
        flow = torch.from_numpy(np.ascontiguousarray(flow)).permute(2, 0, 1)
        valid = ((flow[0].abs() < 1000) & (flow[1].abs() < 1000)).float()
        return img1, img2, flow, valid


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8):
    n_predictions = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    flow_loss = 0.0
    for i, pred in enumerate(flow_preds):
        weight = gamma ** (n_predictions - i - 1)
        i_loss = (pred - flow_gt).abs()
        flow_loss = flow_loss + weight * (valid[:, None] * i_loss).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    metrics = {
        "epe": epe.mean().item(),
        "1px": (epe < 1).float().mean().item(),
        "3px": (epe < 3).float().mean().item(),
    }
    return flow_loss, metrics


@torch.no_grad()
def validate_chairs(model, root, iters=24):
    model.eval()
    val = FlyingChairs(root, split="validation")
    epe_list = []
    for i in range(len(val)):
        img1, img2, flow_gt, _ = val[i]
        img1 = img1[None].cuda()
        img2 = img2[None].cuda()
        _, flow_pr = model(img1, img2, iters=iters, test_mode=True)
        epe = torch.sum((flow_pr[0].cpu() - flow_gt) ** 2, dim=0).sqrt()
        epe_list.append(epe.view(-1).numpy())
    model.train()
    return float(np.mean(np.concatenate(epe_list)))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="raft-chairs")
    p.add_argument("--data_root", required=True)
    p.add_argument("--output", default="checkpoints")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--num_steps", type=int, default=100000)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--image_size", type=int, nargs=2, default=[368, 496])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--wdecay", type=float, default=1e-4)
    p.add_argument("--epsilon", type=float, default=1e-8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.8)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--small", action="store_true")
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--alternate_corr", action="store_true")
    p.add_argument("--val_freq", type=int, default=5000)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)
    np.random.seed(1234 + rank)

    model = RAFT(args).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{args.name}] {n_params / 1e6:.2f}M params, world size {world_size}")

    train_set = FlyingChairs(args.data_root, "training", tuple(args.image_size))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
        cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    os.makedirs(args.output, exist_ok=True)
    total_steps = 0
    epoch = 0
    running = {}
    t0 = time.time()
    model.train()
    while total_steps < args.num_steps:
        for img1, img2, flow, valid in loader:
            img1 = img1.to(device, non_blocking=True)
            img2 = img2.to(device, non_blocking=True)
            flow = flow.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_preds = model(img1, img2, iters=args.iters)
            loss, metrics = sequence_loss([f.float() for f in flow_preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            for k, v in metrics.items():
                running[k] = running.get(k, 0.0) + v
            total_steps += 1

            if rank == 0 and total_steps % 100 == 0:
                msg = ", ".join(f"{k} {v / 100:.4f}" for k, v in running.items())
                print(f"step {total_steps:6d} epoch {epoch} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{msg} ({time.time() - t0:.1f}s)", flush=True)
                running = {}
                t0 = time.time()
            elif total_steps % 100 == 0:
                running = {}

            if total_steps % args.val_freq == 0:
                if rank == 0:
                    path = osp.join(args.output, f"{total_steps}_{args.name}.pth")
                    torch.save(model.module.state_dict(), path)
                    epe = validate_chairs(model.module, args.data_root)
                    print(f"step {total_steps}: chairs val EPE {epe:.3f}", flush=True)
                dist.barrier()

            if total_steps >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), osp.join(args.output, f"{args.name}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
