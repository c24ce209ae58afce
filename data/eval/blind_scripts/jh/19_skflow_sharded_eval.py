"""SKFlow (super-kernel RAFT variant) training on C+T+S+K+H with sharded validation on
Sintel (clean/final) and KITTI-15: EPE plus 1/3/5-px outlier rates, Fl-all.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        19_skflow_sharded_eval.py --stage sintel --restore_ckpt ckpt/skflow-things.pth
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.skflow import SKFlow
from core.utils.utils import InputPadder

logger = logging.getLogger("skflow")
MAX_FLOW = 400


def sequence_loss(flow_preds, flow_gt, valid, gamma):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (pred - flow_gt).abs()).mean()
    return loss


class FlowMeter:
    """Accumulates pixel-level statistics on one rank; `reduce` sums them over ranks."""

    def __init__(self):
        self.epe_sum = 0.0
        self.px1 = 0.0
        self.px3 = 0.0
        self.px5 = 0.0
        self.fl_out = 0.0
        self.n = 0.0

    def update(self, epe, mag=None):
        self.epe_sum += epe.sum().item()
        self.px1 += (epe > 1).sum().item()
        self.px3 += (epe > 3).sum().item()
        self.px5 += (epe > 5).sum().item()
        if mag is not None:
            self.fl_out += ((epe > 3) & (epe / mag > 0.05)).sum().item()
        self.n += epe.numel()

    def reduce(self):
        stats = torch.tensor([self.epe_sum, self.px1, self.px3, self.px5, self.fl_out, self.n],
                             dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        epe_sum, px1, px3, px5, fl_out, n = stats.tolist()
        n = max(n, 1.0)
        return {"epe": epe_sum / n, "1px": 100 * px1 / n, "3px": 100 * px3 / n,
                "5px": 100 * px5 / n, "fl-all": 100 * fl_out / n}


@torch.no_grad()
def validate(net, device, rank, world, iters=32):
    net.eval()
    results = {}
    for name, ds, mode in (("sintel-clean", datasets.MpiSintel(split="training", dstype="clean"), "sintel"),
                           ("sintel-final", datasets.MpiSintel(split="training", dstype="final"), "sintel"),
                           ("kitti", datasets.KITTI(split="training"), "kitti")):
        meter = FlowMeter()
        for idx in range(rank, len(ds), world):
            img1, img2, flow_gt, valid_gt = ds[idx]
            img1, img2 = img1[None].to(device), img2[None].to(device)
            padder = InputPadder(img1.shape, mode=mode)
            img1, img2 = padder.pad(img1, img2)
            _, flow_pr = net(img1, img2, iters=iters if mode == "sintel" else 24, test_mode=True)
            flow = padder.unpad(flow_pr[0])
            flow_gt = flow_gt.to(device)
            epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt().view(-1)
            if mode == "kitti":
                val = valid_gt.to(device).view(-1) >= 0.5
                mag = torch.sum(flow_gt ** 2, dim=0).sqrt().view(-1)
                meter.update(epe[val], mag[val])
            else:
                meter.update(epe)
        results[name] = meter.reduce()
    net.train()
    return results


def build_train_set(args):
    size = args.image_size
    things = datasets.FlyingThings3D({"crop_size": size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True},
                                     dstype="frames_cleanpass")
    aug = {"crop_size": size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
    clean = datasets.MpiSintel(aug, split="training", dstype="clean")
    final = datasets.MpiSintel(aug, split="training", dstype="final")
    kitti = datasets.KITTI({"crop_size": size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
    hd1k = datasets.HD1K({"crop_size": size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
    return 100 * clean + 100 * final + 200 * kitti + 5 * hd1k + things


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="skflow-sintel")
    p.add_argument("--stage", default="sintel")
    p.add_argument("--restore_ckpt", default=None)
    p.add_argument("--output", default="/shared/checkpoints/skflow")
    p.add_argument("--lr", type=float, default=1.75e-4)
    p.add_argument("--num_steps", type=int, default=125000)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--image_size", type=int, nargs=2, default=[368, 768])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--gamma", type=float, default=0.85)
    p.add_argument("--wdecay", type=float, default=1e-5)
    p.add_argument("--k_conv", type=int, nargs="+", default=[1, 15])
    p.add_argument("--PCUpdater_conv", type=int, nargs="+", default=[1, 7])
    p.add_argument("--UpdateBlock", default="SKUpdateBlock6_Deep_nopoolres_AllDecoder")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--val_freq", type=int, default=10000)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    np.random.seed(1234 + rank)
    torch.manual_seed(1234 + rank)

    model = SKFlow(args)
    if args.restore_ckpt:
        sd = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = build_train_set(args)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        logger.info("%d training pairs, %d ranks", len(train_set), world)

    model.train()
    model.module.freeze_bn()
    step, epoch = 0, 0
    tic = time.time()
    loss_sum = torch.zeros(2, device=device)
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2 = img1.to(device, non_blocking=True), img2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            stdv = np.random.uniform(0.0, 5.0)
            img1 = (img1 + stdv * torch.randn_like(img1)).clamp(0.0, 255.0)
            img2 = (img2 + stdv * torch.randn_like(img2)).clamp(0.0, 255.0)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(img1, img2, iters=args.iters)
            loss = sequence_loss([p.float() for p in preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 100 == 0:
                dist.all_reduce(loss_sum)
                logger.info("step %d loss %.4f lr %.2e (%.0fs)", step, (loss_sum[0] / loss_sum[1]).item(),
                            scheduler.get_last_lr()[0], time.time() - tic)
                loss_sum.zero_()
                tic = time.time()
            if step % args.val_freq == 0:
                res = validate(model.module, device, rank, world)
                model.module.freeze_bn()
                for k, v in res.items():
                    logger.info("step %d %s: %s", step, k, " ".join(f"{m} {x:.3f}" for m, x in v.items()))
                if rank == 0:
                    torch.save(model.module.state_dict(), os.path.join(args.output, f"{step}_{args.name}.pth"))
                dist.barrier()
            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.output, f"{args.name}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
