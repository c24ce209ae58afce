# RAFT-small, chairs -> things schedule, distributed data parallel.
#
#   torchrun --nproc_per_node=8 16_raft_small_chairs_things.py --stage chairs --name raft-s-chairs
#   torchrun --nproc_per_node=8 16_raft_small_chairs_things.py --stage things --name raft-s-things \
#       --restore_ckpt checkpoints/raft-s-chairs.pth
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.append("core")
from raft import RAFT  # noqa: E402
import datasets  # noqa: E402
from utils.utils import InputPadder  # noqa: E402

MAX_FLOW = 400
STAGES = {
    "chairs": dict(lr=4e-4, num_steps=100000, image_size=(368, 496), wdecay=1e-4, gamma=0.8),
    "things": dict(lr=1.25e-4, num_steps=100000, image_size=(400, 720), wdecay=1e-4, gamma=0.8),
}


def get_args():
    parser = argparse.ArgumentParser(description="RAFT-small distributed training")
    parser.add_argument("--name", default="raft-small")
    parser.add_argument("--stage", choices=list(STAGES), default="chairs")
    parser.add_argument("--restore_ckpt", default=None)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=4, help="per GPU")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--val_freq", type=int, default=5000)
    parser.add_argument("--ckpt_dir", default="checkpoints")
    args = parser.parse_args()
    for k, v in STAGES[args.stage].items():
        setattr(args, k, v)
    args.small = True
    args.dropout = 0.0
    args.alternate_corr = False
    return args


def fetch_dataset(args):
    if args.stage == "chairs":
        aug = {"crop_size": args.image_size, "min_scale": -0.1, "max_scale": 1.0, "do_flip": True}
        return datasets.FlyingChairs(aug, split="training")
    aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
    return (datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
            + datasets.FlyingThings3D(aug, dstype="frames_finalpass"))


def sequence_loss(flow_preds, flow_gt, valid, gamma):
    n_predictions = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    flow_loss = 0.0
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        flow_loss += i_weight * (valid[:, None] * (flow_preds[i] - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return flow_loss, epe


@torch.no_grad()
def validate_sintel_sharded(net, device, rank, world, iters=32):
    net.eval()
    out = {}
    for dstype in ("clean", "final"):
        ds = datasets.MpiSintel(split="training", dstype=dstype)
        s = torch.zeros(2, dtype=torch.float64, device=device)
        for i in range(rank, len(ds), world):
            img1, img2, flow_gt, _ = ds[i]
            img1, img2 = img1[None].to(device), img2[None].to(device)
            padder = InputPadder(img1.shape)
            img1, img2 = padder.pad(img1, img2)
            _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
            epe = torch.sum((padder.unpad(flow_pr[0]) - flow_gt.to(device)) ** 2, dim=0).sqrt()
            s[0] += epe.sum().double()
            s[1] += epe.numel()
        dist.all_reduce(s)
        out[dstype] = (s[0] / s[1]).item()
    net.train()
    return out


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    np.random.seed(rank)
    torch.manual_seed(rank)

    model = RAFT(args)
    if args.restore_ckpt is not None:
        state = torch.load(args.restore_ckpt, map_location="cpu")
        model.load_state_dict(state, strict=True)
    model = model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    train_set = fetch_dataset(args)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    model.train()
    if args.stage != "chairs":
        model.module.freeze_bn()
    step, epoch = 0, 0
    running = torch.zeros(3, device=device)
    tic = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2 = img1.to(device, non_blocking=True), img2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(img1, img2, iters=args.iters)
            loss, epe = sequence_loss([p.float() for p in preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            running += torch.stack([loss.detach(), epe.sum(), torch.tensor(float(epe.numel()), device=device)])
            if step % 100 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"[{step:6d}] lr {scheduler.get_last_lr()[0]:.2e} loss {running[0].item() / (100 * world):.4f}"
                          f" epe {running[1].item() / max(running[2].item(), 1):.3f} {time.time() - tic:.0f}s",
                          flush=True)
                running.zero_()
                tic = time.time()
            if step % args.val_freq == 0:
                res = validate_sintel_sharded(model.module, device, rank, world)
                if rank == 0:
                    print(f"[{step:6d}] sintel clean {res['clean']:.3f} final {res['final']:.3f}", flush=True)
                    torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, f"{step}_{args.name}.pth"))
                model.train()
                if args.stage != "chairs":
                    model.module.freeze_bn()
            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, f"{args.name}.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
