"""Train RAFT on FlyingChairs with DistributedDataParallel.

torchrun --nproc_per_node=8 train_chairs.py --name raft-chairs --batch_size 16
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
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from core.raft import RAFT
from core.utils import frame_utils
from core.utils.augmentor import FlowAugmentor

cv2.setNumThreads(0)
cv2.ocl.setUseOpenCL(False)

MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


class FlyingChairs(Dataset):
    def __init__(self, aug_params=None, split="training", root="datasets/FlyingChairs_release/data"):
        self.augmentor = FlowAugmentor(**aug_params) if aug_params is not None else None
        images = sorted(glob(osp.join(root, "*.ppm")))
        flows = sorted(glob(osp.join(root, "*.flo")))
        assert len(images) // 2 == len(flows)

        split_list = np.loadtxt("chairs_split.txt", dtype=np.int32)
        self.image_list, self.flow_list = [], []
        for i in range(len(flows)):
            xid = split_list[i]
            if (split == "training" and xid == 1) or (split == "validation" and xid == 2):
                self.flow_list.append(flows[i])
                self.image_list.append([images[2 * i], images[2 * i + 1]])

    def __len__(self):
        return len(self.image_list)

    def __getitem__(self, index):
        flow = frame_utils.read_gen(self.flow_list[index])
        img1 = np.array(frame_utils.read_gen(self.image_list[index][0])).astype(np.uint8)
        img2 = np.array(frame_utils.read_gen(self.image_list[index][1])).astype(np.uint8)
        flow = np.array(flow).astype(np.float32)

        if self.augmentor is not None:
            img1, img2, flow = self.augmentor(img1, img2, flow)

        img1 = torch.from_numpy(img1).permute(2, 0, 1).float()
        img2 = torch.from_numpy(img2).permute(2, 0, 1).float()
        flow = torch.from_numpy(flow).permute(2, 0, 1).float()
        valid = ((flow[0].abs() < 1000) & (flow[1].abs() < 1000)).float()
        return img1, img2, flow, valid


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=MAX_FLOW):
    n_predictions = len(flow_preds)
    flow_loss = 0.0

    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)

    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).mean()

    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt()
    epe = epe.view(-1)[valid.view(-1)]
    metrics = {
        "epe": epe.mean().item(),
        "1px": (epe < 1).float().mean().item(),
        "3px": (epe < 3).float().mean().item(),
        "5px": (epe < 5).float().mean().item(),
    }
    return flow_loss, metrics


@torch.no_grad()
def validate_chairs(model, iters, rank, world_size, device):
    model.eval()
    val_dataset = FlyingChairs(split="validation")
    epe_sum = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for val_id in range(rank, len(val_dataset), world_size):
        image1, image2, flow_gt, _ = val_dataset[val_id]
        image1 = image1[None].to(device)
        image2 = image2[None].to(device)
        _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        epe = torch.sum((flow_pr[0] - flow_gt.to(device)) ** 2, dim=0).sqrt()
        epe_sum += epe.sum()
        count += epe.numel()
    dist.all_reduce(epe_sum)
    dist.all_reduce(count)
    model.train()
    return {"chairs": (epe_sum / count).item()}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft", help="name your experiment")
    parser.add_argument("--restore_ckpt", help="restore checkpoint")
    parser.add_argument("--small", action="store_true", help="use small model")
    parser.add_argument("--lr", type=float, default=0.0004)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=16, help="global batch size")
    parser.add_argument("--image_size", type=int, nargs="+", default=[368, 496])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.0001)
    parser.add_argument("--epsilon", type=float, default=1e-8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.8, help="exponential weighting")
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)

    assert args.batch_size % world_size == 0
    per_gpu_batch = args.batch_size // world_size

    model = RAFT(args)
    if args.restore_ckpt is not None:
        state = torch.load(args.restore_ckpt, map_location="cpu")
        state = {k.replace("module.", "", 1): v for k, v in state.items()}
        model.load_state_dict(state, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model.train()

    if rank == 0:
        print("Parameter Count: %d" % sum(p.numel() for p in model.parameters() if p.requires_grad))

    aug_params = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
    train_dataset = FlyingChairs(aug_params, split="training")
    train_sampler = DistributedSampler(train_dataset, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=args.epsilon)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                              pct_start=0.05, cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    writer = SummaryWriter(log_dir=osp.join("runs", args.name)) if rank == 0 else None
    os.makedirs("checkpoints", exist_ok=True)

    total_steps = 0
    running = {}
    should_keep_training = True
    t0 = time.time()
    while should_keep_training:
        for data_blob in train_loader:
            optimizer.zero_grad(set_to_none=True)
            image1, image2, flow, valid = [x.to(device, non_blocking=True) for x in data_blob]

            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss(flow_predictions, flow, valid, args.gamma)

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            for k, v in metrics.items():
                running[k] = running.get(k, 0.0) + v
            total_steps += 1

            if total_steps % SUM_FREQ == 0:
                keys = sorted(running.keys())
                stats = torch.tensor([running[k] for k in keys], device=device)
                dist.all_reduce(stats)
                stats = stats / (SUM_FREQ * world_size)
                if rank == 0:
                    lr = scheduler.get_last_lr()[0]
                    msg = ", ".join("%s %.4f" % (k, v) for k, v in zip(keys, stats.tolist()))
                    print("[%6d, %10.7f] %s (%.1fs)" % (total_steps, lr, msg, time.time() - t0))
                    for k, v in zip(keys, stats.tolist()):
                        writer.add_scalar(k, v, total_steps)
                    writer.add_scalar("lr", lr, total_steps)
                running = {}

            if total_steps % VAL_FREQ == VAL_FREQ - 1:
                results = validate_chairs(model.module, args.iters * 2, rank, world_size, device)
                if rank == 0:
                    PATH = "checkpoints/%d_%s.pth" % (total_steps + 1, args.name)
                    torch.save(model.module.state_dict(), PATH)
                    for k, v in results.items():
                        writer.add_scalar("val/" + k, v, total_steps)
                    print("validation:", results)
                dist.barrier()

            if total_steps > args.num_steps:
                should_keep_training = False
                break

    if rank == 0:
        torch.save(model.module.state_dict(), "checkpoints/%s.pth" % args.name)
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
