"""HRNet-W48 + DARK decoding, COCO 384x288, fp16.

The person records are parsed once and cached next to the annotations.
Batches whose fp16 loss overflows are dropped (on every rank together).

    torchrun --nproc_per_node=8 18_hrnet_dark_cached_ann.py --cfg configs/w48_384x288_dark.yaml
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from hrnet.models import PoseHighResolutionNet
from hrnet.data import PersonRecordsDataset, parse_person_records
from hrnet.decode import dark_decode, flip_back
from hrnet.metrics import coco_keypoint_ap


def cached_records(ann_file, image_dir, image_size, rank):
    cache = ann_file.replace(".json", f"_records_{image_size[0]}x{image_size[1]}.pkl")
    if rank == 0 and not os.path.exists(cache):
        recs = parse_person_records(COCO(ann_file), image_dir, image_size)
        tmp = f"{cache}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(recs, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, cache)
    dist.barrier()
    with open(cache, "rb") as f:
        return pickle.load(f)


class JointsMSELoss(nn.Module):
    def forward(self, output, target, weight):
        w = weight.unsqueeze(-1)
        return 0.5 * ((output.flatten(2) * w - target.flatten(2) * w) ** 2).mean()


@torch.no_grad()
def run_validation(model, loader, flip_pairs, device):
    model.eval()
    rows = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            hm = model(img)
            hm_f = flip_back(model(img.flip(3)), flip_pairs, shift=True)
        hm = ((hm + hm_f) * 0.5).float()
        coords, maxvals = dark_decode(hm, meta["center"].to(device), meta["scale"].to(device), kernel=11)
        rows.append(torch.cat([meta["index"].to(device).float()[:, None], meta["image_id"].to(device).float()[:, None],
                               meta["box_score"].to(device).float()[:, None], meta["area"].to(device).float()[:, None],
                               torch.cat([coords, maxvals], -1).flatten(1)], 1))
    local = torch.cat(rows)
    # DistributedSampler hands every rank the same number of samples, so the shapes match
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    allrows = torch.cat(gathered).cpu().numpy()
    _, first = np.unique(allrows[:, 0], return_index=True)
    return allrows[first]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    work_dir = cfg["work_dir"]
    writer = None
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(work_dir, "tb"))

    size = tuple(cfg["image_size"])
    train_set = PersonRecordsDataset(cached_records(cfg["train_ann"], cfg["train_images"], size, rank),
                                     size, train=True, sigma=cfg["sigma"])
    val_set = PersonRecordsDataset(cached_records(cfg["val_ann"], cfg["val_images"], size, rank),
                                   size, train=False, sigma=cfg["sigma"])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, cfg["batch_per_gpu"], sampler=train_sampler, num_workers=cfg["workers"],
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, cfg["val_batch_per_gpu"], sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg["workers"], pin_memory=True)

    model = PoseHighResolutionNet(width=48, num_joints=17)
    if cfg.get("imagenet"):
        model.init_weights(cfg["imagenet"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = JointsMSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], 0.1)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 12)

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_ap = ckpt["epoch"], ckpt["best_ap"]

    global_step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, skipped = time.time(), 0
        for i, (img, target, weight, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
            loss = criterion(out.float(), target, weight)
            bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            global_step += 1
            if writer is not None and i % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/loss_scale", scaler.get_scale(), global_step)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch}: {time.time() - t0:.0f}s, {skipped} batches skipped", flush=True)

        if (epoch + 1) % cfg["val_interval"] == 0 or epoch + 1 == cfg["epochs"]:
            rows = run_validation(model, val_loader, val_set.flip_pairs, device)
            if rank == 0:
                stats = coco_keypoint_ap(cfg["val_ann"], rows, os.path.join(work_dir, f"val_{epoch + 1}.json"),
                                         oks_nms=0.9)
                writer.add_scalar("val/AP", stats["AP"], epoch + 1)
                print(f"epoch {epoch + 1}: AP {stats['AP']:.4f} AR {stats['AR']:.4f}", flush=True)
                if stats["AP"] > best_ap:
                    best_ap = stats["AP"]
                    torch.save(model.module.state_dict(), os.path.join(work_dir, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "best_ap": best_ap},
                       os.path.join(work_dir, "checkpoint.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
