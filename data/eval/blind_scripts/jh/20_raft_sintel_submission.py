"""Sintel-stage RAFT fine-tuning that keeps the best checkpoint (by Sintel-final
EPE on a held-out scene list) and writes the Sintel test submission at the end.

    torchrun --nproc_per_node=4 20_raft_sintel_submission.py \
        --restore_ckpt models/raft-things.pth --sintel_root datasets/Sintel
"""
import argparse
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler

from core import datasets
from core.raft import RAFT
from core.utils import frame_utils
from core.utils.utils import InputPadder, forward_interpolate

# scenes held out of fine-tuning for model selection
VAL_SCENES = ("alley_2", "ambush_6", "bamboo_2", "cave_4", "market_6", "temple_3")


def sequence_loss(preds, gt, valid, gamma=0.85, max_flow=400.0):
    n = len(preds)
    mag = torch.sum(gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    return sum(gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean() for i, p in enumerate(preds))


def split_scenes(ds, keep_val):
    """Filter a MpiSintel dataset in place by scene name."""
    keep = [i for i, (s, _) in enumerate(ds.extra_info) if (s in VAL_SCENES) == keep_val]
    ds.image_list = [ds.image_list[i] for i in keep]
    ds.flow_list = [ds.flow_list[i] for i in keep]
    ds.extra_info = [ds.extra_info[i] for i in keep]
    return ds


@torch.no_grad()
def validate(net, device, rank, world, iters=32):
    net.eval()
    val = split_scenes(datasets.MpiSintel(split="training", dstype="final", root=ARGS.sintel_root), keep_val=True)
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(rank, len(val), world):
        img1, img2, flow_gt, _ = val[i]
        img1, img2 = img1[None].to(device), img2[None].to(device)
        padder = InputPadder(img1.shape)
        img1, img2 = padder.pad(img1, img2)
        _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
        epe = torch.sum((padder.unpad(flow_pr[0]) - flow_gt.to(device)) ** 2, dim=0).sqrt()
        acc += torch.stack([epe.sum().double(), torch.tensor(float(epe.numel()), dtype=torch.float64, device=device)])
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def create_sintel_submission(net, device, output_path, iters=32, warm_start=True):
    net.eval()
    for dstype in ("clean", "final"):
        test = datasets.MpiSintel(split="test", aug_params=None, dstype=dstype, root=ARGS.sintel_root)
        flow_prev, sequence_prev = None, None
        for idx in range(len(test)):
            image1, image2, (sequence, frame) = test[idx]
            if sequence != sequence_prev:
                flow_prev = None
            padder = InputPadder(image1.shape)
            image1, image2 = padder.pad(image1[None].to(device), image2[None].to(device))
            flow_low, flow_pr = net(image1, image2, iters=iters, flow_init=flow_prev, test_mode=True)
            flow = padder.unpad(flow_pr[0]).permute(1, 2, 0).cpu().numpy()
            if warm_start:
                flow_prev = forward_interpolate(flow_low[0])[None].to(device)
            out_dir = osp.join(output_path, dstype, sequence)
            os.makedirs(out_dir, exist_ok=True)
            frame_utils.writeFlow(osp.join(out_dir, "frame%04d.flo" % (frame + 1)), flow)
            sequence_prev = sequence


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="raft-sintel-ft")
    p.add_argument("--restore_ckpt", required=True)
    p.add_argument("--sintel_root", default="datasets/Sintel")
    p.add_argument("--output", default="checkpoints")
    p.add_argument("--submission_dir", default="sintel_submission")
    p.add_argument("--lr", type=float, default=1.25e-4)
    p.add_argument("--num_steps", type=int, default=60000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--image_size", type=int, nargs=2, default=[368, 768])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--val_freq", type=int, default=5000)
    p.add_argument("--small", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--alternate_corr", action="store_true")
    p.add_argument("--mixed_precision", action="store_true")
    return p.parse_args()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(rank)

    model = RAFT(ARGS)
    sd = torch.load(ARGS.restore_ckpt, map_location="cpu")
    model.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()})
    model = DDP(model.to(device), device_ids=[local_rank])

    aug = {"crop_size": ARGS.image_size, "min_scale": -0.2, "max_scale": 0.6, "do_flip": True}
    parts = []
    for dstype in ("clean", "final"):
        parts.append(split_scenes(datasets.MpiSintel(aug, split="training", dstype=dstype, root=ARGS.sintel_root),
                                  keep_val=False))
    train_set = ConcatDataset(parts * 20)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=ARGS.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=ARGS.lr, weight_decay=1e-5, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, ARGS.lr, ARGS.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=ARGS.mixed_precision)
    best_path = osp.join(ARGS.output, f"{ARGS.name}_best.pth")
    if rank == 0:
        os.makedirs(ARGS.output, exist_ok=True)

    model.train()
    model.module.freeze_bn()
    step, epoch, best = 0, 0, float("inf")
    tic = time.time()
    while step < ARGS.num_steps:
        sampler.set_epoch(epoch)
        for img1, img2, flow, valid in loader:
            img1, img2, flow, valid = (t.to(device, non_blocking=True) for t in (img1, img2, flow, valid))
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=ARGS.mixed_precision):
                preds = model(img1, img2, iters=ARGS.iters)
            loss = sequence_loss([p.float() for p in preds], flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{time.time() - tic:.0f}s", flush=True)
                tic = time.time()
            if step % ARGS.val_freq == 0:
                epe = validate(model.module, device, rank, world)
                model.module.freeze_bn()
                if rank == 0:
                    print(f"step {step}: held-out sintel final EPE {epe:.3f} (best {best:.3f})", flush=True)
                    if epe < best:
                        best = epe
                        torch.save({"model": model.state_dict(), "step": step, "epe": epe}, best_path)
                dist.barrier()
            if step >= ARGS.num_steps:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        # fresh single-GPU model for the submission run
        net = RAFT(ARGS).to(device)
        ckpt = torch.load(best_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        print(f"writing submission with step-{ckpt['step']} weights (EPE {ckpt['epe']:.3f})", flush=True)
        create_sintel_submission(net, device, ARGS.submission_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    ARGS = parse_args()
    main()
