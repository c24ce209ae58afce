"""ViTPose-H (MAE ViT-H/16 backbone, 32 blocks) on COCO 256x192, single 8-GPU node.

Activation checkpointing per transformer block keeps the batch of 32/GPU in 80GB.

    torchrun --standalone --nproc_per_node=8 17_vitpose_huge_ckpt_blocks.py --mae-ckpt pretrained/mae_pretrain_vit_huge.pth
"""
import argparse
import json
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from vitpose.layers import Block, PatchEmbed
from vitpose.datasets import TopDownCocoDataset
from vitpose.post import keypoints_from_heatmaps, flip_back
from vitpose.coco import evaluate_coco_keypoints

CFG = dict(
    embed_dim=1280, depth=32, num_heads=16, drop_path=0.55, layer_decay=0.85,
    img_size=(256, 192), patch_size=16, num_joints=17,
    lr=5e-4, weight_decay=0.1, batch_per_gpu=32, epochs=210, milestones=(170, 200), warmup_iters=500,
)


class ViTPoseHuge(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["embed_dim"]
        self.patch_embed = PatchEmbed(cfg["img_size"], cfg["patch_size"], 3, d, padding=2)
        self.hw = self.patch_embed.grid_size
        n = self.hw[0] * self.hw[1]
        # cls_token / pos_embed shaped like the MAE checkpoint so it loads 1:1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, d))
        dpr = torch.linspace(0, cfg["drop_path"], cfg["depth"]).tolist()
        self.blocks = nn.ModuleList([Block(d, cfg["num_heads"], mlp_ratio=4, qkv_bias=True, drop_path=dpr[i])
                                     for i in range(cfg["depth"])])
        self.last_norm = nn.LayerNorm(d, eps=1e-6)
        self.deconv = nn.Sequential(
            nn.ConvTranspose2d(d, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(256, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.final_layer = nn.Conv2d(256, cfg["num_joints"], 1)
        self.use_checkpoint = True

    def forward(self, x):
        b = x.shape[0]
        x = self.patch_embed(x) + self.pos_embed[:, 1:] + self.pos_embed[:, :1]
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = cp.checkpoint(blk, x, use_reentrant=True)
            else:
                x = blk(x)
        x = self.last_norm(x).transpose(1, 2).reshape(b, -1, *self.hw)
        return self.final_layer(self.deconv(x))


def build_optimizer(model, cfg):
    num_layers = cfg["depth"] + 1
    groups = {}
    for name, p in model.named_parameters():
        if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
            layer = 0
        elif name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        else:
            layer = num_layers
        wd = 0.0 if (p.ndim == 1 or name in ("cls_token", "pos_embed")) else cfg["weight_decay"]
        scale = cfg["layer_decay"] ** (num_layers - layer)
        groups.setdefault((layer, wd), {"params": [], "weight_decay": wd, "lr_scale": scale})["params"].append(p)
    param_groups = list(groups.values())
    for g in param_groups:
        g["lr"] = cfg["lr"] * g["lr_scale"]
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.999))


def collect_results(part, tmpdir, rank, world):
    """mmcv-style collect through a tmp dir on the node."""
    with open(os.path.join(tmpdir, f"part_{rank}.json"), "w") as f:
        json.dump(part, f)
    dist.barrier()
    if rank != 0:
        return None
    merged = {}
    for r in range(world):
        with open(os.path.join(tmpdir, f"part_{r}.json")) as f:
            for item in json.load(f):
                merged[item["idx"]] = item
    shutil.rmtree(tmpdir, ignore_errors=True)
    return list(merged.values())


@torch.no_grad()
def evaluate(model, loader, dataset, work_dir, epoch, rank, world):
    model.eval()
    part = []
    for b in loader:
        img = b["img"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            hm = model(img)
            hm_flip = flip_back(model(img.flip(3)), dataset.flip_pairs)
        hm = ((hm + hm_flip) * 0.5).float().cpu().numpy()
        kpts = keypoints_from_heatmaps(hm, b["center"].numpy(), b["scale"].numpy(), use_udp=True)
        for i in range(len(kpts)):
            part.append({"idx": int(b["idx"][i]), "image_id": int(b["image_id"][i]),
                         "keypoints": kpts[i].tolist(), "box_score": float(b["box_score"][i]),
                         "area": float(b["area"][i])})
    tmpdir = os.path.join(work_dir, f".eval_tmp_{epoch}")
    if rank == 0:
        os.makedirs(tmpdir, exist_ok=True)
    dist.barrier()
    results = collect_results(part, tmpdir, rank, world)
    if rank != 0:
        return None
    return evaluate_coco_keypoints(dataset.ann_file, results, os.path.join(work_dir, f"result_keypoints_{epoch}.json"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", default="data/coco")
    parser.add_argument("--mae-ckpt", required=True)
    parser.add_argument("--work-dir", default="work_dirs/vitpose_huge_256x192")
    args = parser.parse_args()
    cfg = CFG

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_set = TopDownCocoDataset(args.data_root, "train2017", cfg["img_size"], train=True, use_udp=True)
    val_set = TopDownCocoDataset(args.data_root, "val2017", cfg["img_size"], train=False, use_udp=True,
                                 det_bbox_file="person_detection_results/COCO_val2017_detections_AP_H_56_person.json")
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, cfg["batch_per_gpu"], sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8,
                            pin_memory=True)

    model = ViTPoseHuge(cfg)
    mae = torch.load(args.mae_ckpt, map_location="cpu")["model"]
    missing, unexpected = model.load_state_dict({k: v for k, v in mae.items() if not k.startswith("norm.")},
                                                strict=False)
    if rank == 0:
        print("missing:", missing, "\nunexpected:", unexpected, flush=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    optimizer = build_optimizer(model, cfg)
    # cls_token is kept only so the MAE weights load; it is never used in forward
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    scaler = torch.cuda.amp.GradScaler()

    it_per_epoch = len(loader)
    total_it = 0
    best_ap = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        decay = 0.1 ** sum(epoch >= m for m in cfg["milestones"])
        for i, b in enumerate(loader):
            warm = min(1.0, (total_it + 1) / cfg["warmup_iters"])
            for g in optimizer.param_groups:
                g["lr"] = cfg["lr"] * g["lr_scale"] * decay * warm
            img = b["img"].cuda(non_blocking=True)
            target = b["target"].cuda(non_blocking=True)
            tw = b["target_weight"].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
            loss = 0.5 * F.mse_loss(out.float() * tw[..., None], target * tw[..., None])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            total_it += 1
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} [{i}/{it_per_epoch}] loss {loss.item():.6f} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == cfg["epochs"]:
            stats = evaluate(model, val_loader, val_set, args.work_dir, epoch + 1, rank, world)
            if rank == 0:
                print(f"epoch {epoch + 1}: {json.dumps(stats)}", flush=True)
                if stats["AP"] > best_ap:
                    best_ap = stats["AP"]
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best_AP.pth"))
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.work_dir, "latest.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
