"""Multi-GPU PWC-Net training (FlyingChairs, then FlyingThings3D fine-tuning).

Single node:   python 04_pwcnet_spawn.py --data /data/FlyingChairs_release/data --gpus 4
Uses torch.multiprocessing so it can be started the same way on the lab machines
that have no torchrun wrapper set up.
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from models.pwcnet import PWCDCNet
from data.flow_datasets import FlyingChairs, FlyingThings, MpiSintel
from utils.flow_utils import flow_to_color

# weights of the multi-scale loss, coarsest (1/64) level first, finest (1/4) last
LEVEL_WEIGHTS = [0.32, 0.08, 0.02, 0.01, 0.005]
FLOW_DIV = 20.0


def multiscale_epe_loss(flow_preds, flow_gt, valid):
    """PWC-Net training loss: L2 norm summed over pixels, for every pyramid level.

    flow_preds are ordered coarse -> fine, in units of FLOW_DIV px.
    """
    total = 0.0
    gt = flow_gt / FLOW_DIV
    for w, pred in zip(LEVEL_WEIGHTS, flow_preds):
        h, wd = pred.shape[-2:]
        scale_y, scale_x = h / gt.shape[-2], wd / gt.shape[-1]
        gt_l = F.interpolate(gt, size=(h, wd), mode="area")
        gt_l = gt_l * torch.tensor([scale_x, scale_y], device=gt.device).view(1, 2, 1, 1)
        valid_l = F.interpolate(valid[:, None].float(), size=(h, wd), mode="area") > 0.99
        epe = torch.norm(pred - gt_l, p=2, dim=1, keepdim=True)
        total = total + w * (epe * valid_l).sum() / pred.shape[0]
    return total


def build_dataset(args):
    if args.stage == "chairs":
        return FlyingChairs(args.data, split="train", crop=(384, 448), augment=True)
    if args.stage == "things":
        return FlyingThings(args.data, passes=("clean", "final"), crop=(384, 768), augment=True)
    raise ValueError(args.stage)


def setup_logger(rank, out_dir):
    logger = logging.getLogger("pwcnet")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(out_dir, "train.log"))
        fh.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(fh)
        logger.addHandler(logging.StreamHandler())
    return logger


@torch.no_grad()
def validate_sintel(model, sintel_root, device, rank, world_size):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    val = MpiSintel(sintel_root, split="train", dstype="clean", augment=False)
    for idx in range(rank, len(val), world_size):
        img1, img2, flow_gt, _ = val[idx]
        img1, img2 = img1[None].to(device), img2[None].to(device)
        h, w = img1.shape[-2:]
        H, W = int(np.ceil(h / 64) * 64), int(np.ceil(w / 64) * 64)
        x1 = F.interpolate(img1, (H, W), mode="bilinear", align_corners=False)
        x2 = F.interpolate(img2, (H, W), mode="bilinear", align_corners=False)
        flow = model(x1, x2)[-1] * FLOW_DIV        # 1/4 resolution, in pixels of that resolution
        fh, fw = flow.shape[-2:]
        flow = F.interpolate(flow, (h, w), mode="bilinear", align_corners=False)
        flow[:, 0] *= w / fw
        flow[:, 1] *= h / fh
        epe = torch.norm(flow[0].cpu() - flow_gt, dim=0)
        stats[0] += epe.mean().item()
        stats[1] += 1
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    logger = setup_logger(rank, args.out_dir)

    model = PWCDCNet(md=4).to(device)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        model.load_state_dict(sd["model"] if "model" in sd else sd)
    model = DDP(model, device_ids=[gpu])

    dataset = build_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    per_gpu = args.batch_size // world_size
    loader = DataLoader(dataset, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=4e-4)
    # S_long schedule: halve the lr at 400k, 600k, 800k, 1M iterations
    milestones = [int(m * args.iters_scale) for m in (400000, 600000, 800000, 1000000)]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.5)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow_gt, valid in loader:
            img1 = img1.to(device, non_blocking=True)
            img2 = img2.to(device, non_blocking=True)
            flow_gt = flow_gt.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)

            flow_preds = model(img1, img2)
            loss = multiscale_epe_loss(flow_preds, flow_gt, valid)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_every == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t)
                logger.info("step %d/%d loss %.4f lr %.2e %.3fs/it", step, args.num_steps,
                            loss_t.item() / world_size, scheduler.get_last_lr()[0], (time.time() - t0) / args.log_every)
                t0 = time.time()

            if step % args.val_every == 0 or step == args.num_steps:
                if args.sintel:
                    epe = validate_sintel(model.module, args.sintel, device, rank, world_size)
                    logger.info("step %d sintel-clean EPE %.3f", step, epe)
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, os.path.join(args.out_dir, "pwcnet_%07d.pth" % step))
                dist.barrier()

            if step >= args.num_steps:
                break
        epoch += 1

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--stage", default="chairs", choices=["chairs", "things"])
    parser.add_argument("--sintel", default="", help="Sintel root for validation")
    parser.add_argument("--pretrained", default="")
    parser.add_argument("--out_dir", default="runs/pwcnet")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--dist_url", default="tcp://127.0.0.1:23456")
    parser.add_argument("--batch_size", type=int, default=8, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--num_steps", type=int, default=1200000)
    parser.add_argument("--iters_scale", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--val_every", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    mp.spawn(main_worker, nprocs=args.gpus, args=(args, args.gpus))


if __name__ == "__main__":
    main()
