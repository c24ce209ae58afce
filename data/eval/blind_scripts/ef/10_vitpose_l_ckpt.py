"""ViTPose-L (classic deconv decoder) on COCO + our multi-sport set.

ViT-L at 256x192 with batch 32/GPU does not fit on the 40GB A100s without
activation checkpointing, so the transformer blocks are checkpointed.

    torchrun --nproc_per_node=8 vitpose_l_ckpt.py --cfg configs/vitpose_l_multisport.yaml
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
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
import yaml
from pycocotools.cocoeval import COCOeval
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]

DEFAULT_CFG = dict(
    coco_root="/mnt/datasets/coco",
    sport_root="/mnt/datasets/multisport",
    mae_ckpt="weights/mae_pretrain_vit_large.pth",
    work_dir="/mnt/exp/vitpose_l",
    epochs=210,
    batch_size=32,
    lr=5e-4,
    weight_decay=0.1,
    layer_decay=0.8,
    drop_path=0.5,
    use_checkpoint=True,
    find_unused_parameters=True,
    workers=8,
)


class ViTPoseL(nn.Module):
    def __init__(self, img_size=(256, 192), num_joints=17, dim=1024, depth=24, heads=16, drop_path=0.5,
                 use_checkpoint=False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=16, in_chans=3, embed_dim=dim)
        self.grid = (img_size[0] // 16, img_size[1] // 16)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1] + 1, dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True, drop_path=dpr[i]) for i in range(depth)])
        self.last_norm = nn.LayerNorm(dim, eps=1e-6)
        self.keypoint_head = nn.Sequential(
            nn.ConvTranspose2d(dim, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(256, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, num_joints, 1))

    def forward(self, x):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, 1:] + self.pos_embed[:, :1]
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = checkpoint.checkpoint(blk, x)
            else:
                x = blk(x)
        x = self.last_norm(x)
        b, _, c = x.shape
        return self.keypoint_head(x.transpose(1, 2).reshape(b, c, *self.grid))


def layer_id(name, depth):
    if name.startswith(("patch_embed", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def build_optimizer(model, cfg, depth=24):
    groups = {}
    for n, p in model.named_parameters():
        lid = layer_id(n, depth)
        decay = not (p.ndim == 1 or n.endswith("pos_embed"))
        g = groups.setdefault((lid, decay), {"params": [], "weight_decay": cfg["weight_decay"] if decay else 0.0,
                                             "lr_scale": cfg["layer_decay"] ** (depth + 1 - lid)})
        g["params"].append(p)
    return torch.optim.AdamW(list(groups.values()), lr=cfg["lr"], betas=(0.9, 0.999))


def adjust_lr(optimizer, step, total, base_lr, warmup=500):
    if step < warmup:
        lr = base_lr * (step + 1) / warmup
    else:
        lr = base_lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]


@torch.no_grad()
def evaluate(model, loader, ds, device, out_path):
    model.eval()
    res = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hm = model(img).float()
            hm_f = model(img.flip(3)).float()
        hm_f = torch.from_numpy(flip_back(hm_f.cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        heat = ((hm + hm_f) * 0.5).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            m = mv[n, :, 0] > 0.2
            res.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                        "keypoints": np.hstack([kp[n], mv[n]]).ravel().tolist(),
                        "score": float(mv[n, m, 0].mean()) if m.any() else 0.0})
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    if dist.get_rank() != 0:
        return None
    uniq = {r.pop("index"): r for chunk in allres for r in chunk}
    with open(out_path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(ds.coco, ds.coco.loadRes(out_path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return E.stats[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    cli = parser.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, udp=True)
    train_ds = ConcatDataset([
        TopDownCocoDataset(cfg["coco_root"], "annotations/person_keypoints_train2017.json", "train2017", train=True, **kw),
        TopDownCocoDataset(cfg["sport_root"], "annotations/train.json", "images", train=True, **kw),
    ])
    val_ds = TopDownCocoDataset(cfg["sport_root"], "annotations/val.json", "images", train=False, **kw)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=cfg["workers"],
                        pin_memory=True)

    model = ViTPoseL(drop_path=cfg["drop_path"], use_checkpoint=cfg["use_checkpoint"])
    mae = torch.load(cfg["mae_ckpt"], map_location="cpu")["model"]
    mae = {k: v for k, v in mae.items() if k.startswith(("patch_embed", "blocks"))}
    model.load_state_dict(mae, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = build_optimizer(model, cfg)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=cfg["find_unused_parameters"])

    total = cfg["epochs"] * len(train_dl)
    step, best = 0, 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for img, target, weight, _ in train_dl:
            adjust_lr(optimizer, step, total, cfg["lr"])
            img, target, weight = (t.to(device, non_blocking=True) for t in (img, target, weight))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.float().view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} loss {(meter[0] / meter[1]).item():.6f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % 10 == 0:
            ap = evaluate(model, val_dl, val_ds, device, os.path.join(cfg["work_dir"], "val_results.json"))
            if rank == 0:
                print(f"epoch {epoch} AP {ap:.4f}", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(cfg["work_dir"], "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "step": step, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(cfg["work_dir"], "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
