"""RAFT 'C+T+S+K+H' mixed-dataset stage, DistributedDataParallel.

    torchrun --nproc_per_node=4 14_raft_mixed_sequence.py --name raft-sintel --stage sintel \
        --restore_ckpt checkpoints/raft-things.pth --validation sintel --batch_size 8 \
        --lr 0.000125 --image_size 368 768 --wdecay 0.00001 --gamma 0.85 --mixed_precision
"""
import argparse
import datetime
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.append("core")
from raft import RAFT  # noqa: E402
import datasets  # noqa: E402
import evaluate  # noqa: E402

MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


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
    return flow_loss, torch.stack([epe.mean(), (epe < 1).float().mean(), (epe < 3).float().mean(),
                                   (epe < 5).float().mean()]).detach()


def fetch_dataset(args):
    if args.stage == "sintel":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
        things = datasets.FlyingThings3D(aug_params, dstype="frames_cleanpass")
        sintel_clean = datasets.MpiSintel(aug_params, split="training", dstype="clean")
        sintel_final = datasets.MpiSintel(aug_params, split="training", dstype="final")
        kitti = datasets.KITTI({"crop_size": args.image_size, "min_scale": -0.3, "max_scale": 0.5, "do_flip": True})
        hd1k = datasets.HD1K({"crop_size": args.image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
        return 100 * sintel_clean + 100 * sintel_final + 200 * kitti + 5 * hd1k + things
    if args.stage == "things":
        aug_params = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        return (datasets.FlyingThings3D(aug_params, dstype="frames_cleanpass")
                + datasets.FlyingThings3D(aug_params, dstype="frames_finalpass"))
    raise ValueError(args.stage)


def main(args):
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    # Sintel validation (2 x 1041 frames, 32 iterations) runs on rank 0 only; the other ranks wait in a barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    device = torch.device("cuda", local_rank)
    np.random.seed(1234 + rank)
    torch.manual_seed(1234)

    model = RAFT(args)
    if args.restore_ckpt is not None and rank == 0:
        # DDP broadcasts rank 0's parameters and buffers when it wraps the model,
        # so reading the file on one rank is enough
        state = torch.load(args.restore_ckpt, map_location="cpu")
        state = {k.replace("module.", "", 1): v for k, v in state.items()}
        print(model.load_state_dict(state, strict=False))
    model.to(device)
    model.train()
    model = DDP(model, device_ids=[local_rank])
    if args.stage != "chairs":
        model.module.freeze_bn()

    assert args.batch_size % world_size == 0
    train_dataset = fetch_dataset(args)
    sampler = DistributedSampler(train_dataset, shuffle=True)
    loader = DataLoader(train_dataset, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                              cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    writer = SummaryWriter(os.path.join("runs", args.name)) if rank == 0 else None
    running = torch.zeros(4, device=device)

    total_steps, epoch = 0, 0
    tic = time.time()
    should_keep_training = True
    while should_keep_training:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            optimizer.zero_grad()
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            if args.add_noise:
                stdv = np.random.uniform(0.0, 5.0)
                image1 = (image1 + stdv * torch.randn_like(image1)).clamp(0.0, 255.0)
                image2 = (image2 + stdv * torch.randn_like(image2)).clamp(0.0, 255.0)

            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                flow_predictions = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss([f.float() for f in flow_predictions], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()

            running += metrics
            total_steps += 1
            if total_steps % SUM_FREQ == 0:
                dist.all_reduce(running)
                running /= (SUM_FREQ * world_size)
                if rank == 0:
                    epe, px1, px3, px5 = running.tolist()
                    print(f"[{total_steps:6d}, {scheduler.get_last_lr()[0]:10.7f}] epe {epe:.4f} 1px {px1:.3f} "
                          f"3px {px3:.3f} 5px {px5:.3f} ({(time.time() - tic) / SUM_FREQ:.2f}s/it)", flush=True)
                    for k, v in zip(["epe", "1px", "3px", "5px"], (epe, px1, px3, px5)):
                        writer.add_scalar(k, v, total_steps)
                running.zero_()
                tic = time.time()

            if total_steps % VAL_FREQ == 0:
                if rank == 0:
                    torch.save(model.module.state_dict(), f"checkpoints/{total_steps}_{args.name}.pth")
                    results = {}
                    for val_dataset in args.validation:
                        if val_dataset == "sintel":
                            results.update(evaluate.validate_sintel(model.module))
                        elif val_dataset == "kitti":
                            results.update(evaluate.validate_kitti(model.module))
                    for k, v in results.items():
                        writer.add_scalar(k, v, total_steps)
                    model.train()
                    if args.stage != "chairs":
                        model.module.freeze_bn()
                dist.barrier()

            if total_steps >= args.num_steps:
                should_keep_training = False
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), f"checkpoints/{args.name}.pth")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft")
    parser.add_argument("--stage", default="sintel")
    parser.add_argument("--restore_ckpt", default=None)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--validation", type=str, nargs="+", default=[])
    parser.add_argument("--lr", type=float, default=0.000125)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=8, help="total over all GPUs")
    parser.add_argument("--image_size", type=int, nargs="+", default=[368, 768])
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=0.00001)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=0.85)
    parser.add_argument("--add_noise", action="store_true")
    args = parser.parse_args()

    os.makedirs("checkpoints", exist_ok=True)
    main(args)
