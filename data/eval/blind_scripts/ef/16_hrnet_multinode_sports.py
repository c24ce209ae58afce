"""Multi-node HRNet-W48 trainer for the all-sports keypoint set (2 x 8 GPUs).

Checkpoints and eval dumps go to the Lustre share so that any node can resume.

    # on each node (NODE_RANK=0/1):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 --rdzv_id=w48_allsports \
        hrnet_multinode_sports.py --data /lustre/sportpose/allsports --out /lustre/sportpose/exp/w48_allsports
"""
import argparse
import json
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/lustre/sportpose/allsports")
    p.add_argument("--out", default="/lustre/sportpose/exp/w48_allsports")
    p.add_argument("--epochs", type=int, default=210)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--base-lr", type=float, default=1e-3, help="for a global batch of 128")
    p.add_argument("--warmup-epochs", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--wandb-project", default="allsports-pose")
    return p.parse_args()


class HRNetW48(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w48", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def cosine_warmup(step, total, warmup):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, ds, device, out_dir, epoch):
    model.eval()
    dets = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hm = model(img).float()
            hm_f = model(img.flip(3)).float()
        hm_f = torch.from_numpy(flip_back(hm_f.cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        heat = ((hm + hm_f) * 0.5).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            v = mv[n, :, 0] > 0.2
            dets.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.hstack([kp[n], mv[n]]).ravel().tolist(),
                         "score": float(mv[n, v, 0].mean()) if v.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    ap = torch.zeros(1, device=device)
    if dist.get_rank() == 0:
        uniq = {d.pop("index"): d for part in parts for d in part}
        path = os.path.join(out_dir, f"val_ep{epoch:03d}.json")
        with open(path, "w") as f:
            json.dump(list(uniq.values()), f)
        E = COCOeval(ds.coco, ds.coco.loadRes(path), "keypoints")
        E.params.useSegm = None
        E.evaluate(); E.accumulate(); E.summarize()
        ap[0] = E.stats[0]
    dist.broadcast(ap, src=0)
    return ap.item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, name=os.path.basename(args.out), config=vars(args), dir=args.out)
    dist.barrier()

    kw = dict(image_size=[288, 384], sigma=3, flip_pairs=FLIP_PAIRS)
    train_ds = TopDownCocoDataset(args.data, "annotations/train.json", "images", train=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/val.json", "images", train=False, **kw)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=48, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetW48()).to(device)
    model = DDP(model, device_ids=[local_rank])

    # linear LR scaling: 16 GPUs x 16 = 256 images per step
    global_batch = args.batch_size * world
    peak_lr = args.base_lr * global_batch / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=1e-4)
    iters_per_epoch = len(train_dl)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = int(args.warmup_epochs * iters_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_warmup(s, total_iters, warmup_iters))

    ckpt_path = os.path.join(args.out, "latest.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        if ckpt.get("world_size") != world:
            raise RuntimeError(f"checkpoint was written with world size {ckpt.get('world_size')}, now {world}; "
                               "the LR schedule assumes the same global batch")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for it, (img, target, weight, _) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.float().view(b, k, -1) * weight, target.view(b, k, -1) * weight)

            # all ranks agree on skipping, otherwise the gradient all-reduce desynchronises
            bad = (~torch.isfinite(loss.detach())).float().reshape(1)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                meter[2] += 1
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                continue

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            meter[0] += loss.detach()
            meter[1] += 1
            if is_main and it % 100 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0]},
                          step=epoch * iters_per_epoch + it)
        dist.all_reduce(meter)
        if is_main:
            print(f"epoch {epoch}: loss {(meter[0] / meter[1].clamp(min=1)).item():.6f} "
                  f"skipped {int(meter[2].item())} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = evaluate(model, val_dl, val_ds, device, args.out, epoch)
            if is_main:
                wandb.log({"val/AP": ap, "epoch": epoch}, step=(epoch + 1) * iters_per_epoch)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if is_main:
            tmp = ckpt_path + ".tmp"
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best, "world_size": world}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
