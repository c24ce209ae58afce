"""Pre-train RAFT on AutoFlow (static 40k pairs) instead of Chairs/Things.

Runs are pre-emptible, so the script resumes from <out>/latest.pth when it exists.

    torchrun --nproc_per_node=8 20_raft_autoflow.py --autoflow_root /data/autoflow/static_40k \
        --out checkpoints/raft_autoflow --batch_size 32 --lr 4e-4 --num_steps 200000
"""
import argparse
import glob
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.append("core")
from raft import RAFT  # noqa: E402
from utils import frame_utils  # noqa: E402
from utils.augmentor import FlowAugmentor  # noqa: E402
import datasets  # noqa: E402


class AutoFlow(Dataset):
    def __init__(self, root, crop_size):
        self.scenes = sorted(glob.glob(os.path.join(root, "*", "*")))
        self.augmentor = FlowAugmentor(crop_size, min_scale=-0.1, max_scale=1.0, do_flip=True)

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, index):
        scene = self.scenes[index]
        img1 = np.array(frame_utils.read_gen(os.path.join(scene, "im0.png"))).astype(np.uint8)[..., :3]
        img2 = np.array(frame_utils.read_gen(os.path.join(scene, "im1.png"))).astype(np.uint8)[..., :3]
        flow = np.array(frame_utils.read_gen(os.path.join(scene, "forward.flo"))).astype(np.float32)
        img1, img2, flow = self.augmentor(img1, img2, flow)
        img1 = torch.from_numpy(img1).permute(2, 0, 1).float()
        img2 = torch.from_numpy(img2).permute(2, 0, 1).float()
        flow = torch.from_numpy(flow).permute(2, 0, 1).float()
        valid = ((flow[0].abs() < 1000) & (flow[1].abs() < 1000)).float()
        return img1, img2, flow, valid


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=400):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * (pred - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return loss, epe.mean().detach()


@torch.no_grad()
def validate_sintel_clean(model, device, rank, world, iters=32):
    model.eval()
    ds = datasets.MpiSintel(split="training", dstype="clean")
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(rank, len(ds), world):
        image1, image2, flow_gt, _ = ds[i]
        image1, image2 = image1[None].to(device), image2[None].to(device)
        h, w = image1.shape[-2:]
        ph, pw = (8 - h % 8) % 8, (8 - w % 8) % 8
        image1 = F.pad(image1, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], mode="replicate")
        image2 = F.pad(image2, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], mode="replicate")
        _, flow_pr = model(image1, image2, iters=iters, test_mode=True)
        flow = flow_pr[0, :, ph // 2:ph // 2 + h, pw // 2:pw // 2 + w].cpu()
        epe = torch.sum((flow - flow_gt) ** 2, dim=0).sqrt()
        acc[0] += epe.sum().item()
        acc[1] += epe.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--autoflow_root", required=True)
    parser.add_argument("--out", default="checkpoints/raft_autoflow")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--batch_size", type=int, default=32, help="global")
    parser.add_argument("--image_size", type=int, nargs=2, default=[368, 496])
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--wdecay", type=float, default=1e-4)
    parser.add_argument("--num_steps", type=int, default=200000)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--save_every", type=int, default=5000)
    parser.add_argument("--val_every", type=int, default=20000)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    model = RAFT(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
                                                    cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    step = 0
    latest = os.path.join(args.out, "latest.pth")
    if os.path.exists(latest):
        ckpt = torch.load(latest, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {latest} at step {step}", flush=True)

    model.train()
    model = DDP(model, device_ids=[local_rank])

    train_set = AutoFlow(args.autoflow_root, args.image_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    epoch = step // len(loader)
    t0 = time.time()
    while step < args.num_steps:
        sampler.set_epoch(epoch)
        for image1, image2, flow, valid in loader:
            image1, image2 = image1.to(device, non_blocking=True), image2.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                preds = model(image1, image2, iters=args.iters)
            loss, epe = sequence_loss([p.float() for p in preds], flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if step % 100 == 0:
                stats = torch.stack([loss.detach(), epe])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/epe", stats[1].item(), step)
                    writer.add_scalar("lr", scheduler.get_last_lr()[0], step)
                    print(f"step {step} loss {stats[0]:.3f} epe {stats[1]:.3f} "
                          f"{(time.time() - t0) / 100:.2f}s/it", flush=True)
                    t0 = time.time()

            if step % args.save_every == 0 and rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step}
                torch.save(state, latest + ".tmp")
                os.replace(latest + ".tmp", latest)

            if step % args.val_every == 0:
                epe_val = validate_sintel_clean(model.module, device, rank, world)
                if rank == 0:
                    writer.add_scalar("val/sintel_clean_epe", epe_val, step)
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"raft_autoflow_{step:06d}.pth"))
                    print(f"step {step}: sintel clean EPE {epe_val:.3f}", flush=True)
                dist.barrier()

            if step >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "raft_autoflow_final.pth"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
