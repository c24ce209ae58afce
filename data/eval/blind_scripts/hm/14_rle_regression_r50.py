"""Regression-based top-down pose with Residual Log-likelihood Estimation (RLE), ResNet-50.

The head regresses normalised (x, y) and sigma per joint; a RealNVP flow models
the residual density. COCO train2017, evaluation on val2017 with detector boxes.

    torchrun --nproc_per_node=8 14_rle_regression_r50.py --cfg configs/rle_r50_256x192.yaml
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from rle.data import COCOTopDownReg
from rle.flow import RealNVP
from rle.evaluation import coco_eval_results


class RegressFlow(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc_coord = nn.Linear(2048, num_joints * 2)
        self.fc_sigma = nn.Linear(2048, num_joints * 2)
        self.flow = RealNVP(dim=2, hidden=64, num_layers=3)
        self.num_joints = num_joints
        nn.init.xavier_uniform_(self.fc_coord.weight, gain=0.01)
        nn.init.xavier_uniform_(self.fc_sigma.weight, gain=0.01)

    def forward(self, x, target_uv=None):
        feat = self.pool(self.backbone(x)).flatten(1)
        b = feat.shape[0]
        pred = self.fc_coord(feat).reshape(b, self.num_joints, 2)
        sigma = self.fc_sigma(feat).reshape(b, self.num_joints, 2).sigmoid() + 1e-9
        out = {"pred": pred, "sigma": sigma, "maxvals": 1.0 - sigma.mean(-1, keepdim=True)}
        if target_uv is not None:
            bar_mu = (pred - target_uv) / sigma
            out["nf_loss"] = -self.flow.log_prob(bar_mu.reshape(-1, 2)).reshape(b, self.num_joints, 1)
        return out


def rle_loss(out, target_uv, target_weight, amp=1 / math.sqrt(2 * math.pi)):
    sigma = out["sigma"]
    nf = torch.log(sigma) + out["nf_loss"]
    q = torch.log(sigma / amp) + torch.abs(out["pred"] - target_uv) / (math.sqrt(2) * sigma + 1e-9)
    loss = (nf + q) * target_weight
    return loss.sum() / target_weight.shape[0]


@torch.no_grad()
def evaluate(model, loader, cfg, out_dir, epoch):
    model.eval()
    rows = []
    for b in loader:
        img = b["img"].cuda(non_blocking=True)
        out = model(img)
        if cfg["flip_test"]:
            out_f = model(img.flip(3))
            pred_f = out_f["pred"][:, b["flip_index"][0]]
            pred_f[..., 0] = -pred_f[..., 0]
            out["pred"] = (out["pred"] + pred_f) / 2
        # normalised crop coordinates in [-0.5, 0.5] -> image coordinates
        c = b["center"].cuda()
        s = b["scale"].cuda() * 200
        xy = out["pred"] * s[:, None, :] + c[:, None, :]
        kpts = torch.cat([xy, out["maxvals"]], -1).cpu().numpy()
        for i in range(kpts.shape[0]):
            rows.append({"idx": int(b["idx"][i]), "image_id": int(b["image_id"][i]),
                         "keypoints": kpts[i].reshape(-1).tolist(), "bbox_score": float(b["bbox_score"][i]),
                         "area": float(b["area"][i])})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    if dist.get_rank() != 0:
        return None
    merged = list({r["idx"]: r for p in parts for r in p}.values())
    return coco_eval_results(cfg["val_ann"], merged, os.path.join(out_dir, f"kpt_results_{epoch}.json"),
                             oks_nms_thr=0.9, rescore=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--exp-dir", default="exp/rle_r50")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()

    train_set = COCOTopDownReg(cfg["train_ann"], cfg["train_img"], input_size=cfg["input_size"], train=True)
    val_set = COCOTopDownReg(cfg["val_ann"], cfg["val_img"], input_size=cfg["input_size"], train=False,
                             det_file=cfg["det_file"])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg["workers"], pin_memory=True)

    model = RegressFlow(cfg["num_joints"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg["lr_steps"], gamma=0.1)

    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
        with open(os.path.join(args.exp_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    best_ap = 0.0
    for epoch in range(cfg["epochs"]):
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device="cuda")
        for i, b in enumerate(train_loader):
            img = b["img"].cuda(non_blocking=True)
            target_uv = b["target_uv"].cuda(non_blocking=True)
            target_weight = b["target_weight"].cuda(non_blocking=True)
            out = model(img, target_uv)
            loss = rle_loss(out, target_uv, target_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device="cuda")])
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()
        dist.all_reduce(loss_sum)
        mean_loss = (loss_sum[0] / loss_sum[1]).item()

        stats = None
        if (epoch + 1) % cfg["val_every"] == 0 or epoch + 1 == cfg["epochs"]:
            stats = evaluate(model, val_loader, cfg, args.exp_dir, epoch + 1)
        if rank == 0:
            print(f"epoch {epoch}: loss {mean_loss:.4f} {json.dumps(stats) if stats else ''} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.exp_dir, "last.pth"))
            if stats is not None and stats["AP"] > best_ap:
                best_ap = stats["AP"]
                torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
