"""ViTPose-B (simple decoder) trainer, initialised from MAE ImageNet weights.

Long schedule (210 ep) that gets pre-empted on the shared cluster, so it is
restarted with --resume from the last checkpoint most of the time.

    torchrun --nproc_per_node=8 vitpose_b_train.py --mae weights/mae_pretrain_vit_base.pth \
        --data /mnt/datasets/coco --work-dir /mnt/exp/vitpose_b --resume /mnt/exp/vitpose_b/latest.pth
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.cocoeval import COCOeval
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


class ViTPose(nn.Module):
    def __init__(self, img_size=(256, 192), patch=16, dim=768, depth=12, heads=12, num_joints=17, drop_path=0.3):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch, in_chans=3, embed_dim=dim)
        self.grid = (img_size[0] // patch, img_size[1] // patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1] + 1, dim))
        dpr = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4.0, qkv_bias=True, drop_path=dpr[i])
                                     for i in range(depth)])
        self.last_norm = nn.LayerNorm(dim, eps=1e-6)
        # "simple" decoder from the ViTPose paper: upsample x4 + 3x3 conv
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(dim, num_joints, 3, padding=1))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, 1:] + self.pos_embed[:, :1]
        for blk in self.blocks:
            x = blk(x)
        x = self.last_norm(x)
        b, n, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, *self.grid)
        x = F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=False)
        return self.head(x)


def load_mae(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k: v for k, v in sd.items() if not k.startswith(("decoder", "mask_token", "head", "norm."))}
    if "pos_embed" in sd and sd["pos_embed"].shape != model.pos_embed.shape:
        cls_tok, grid = sd["pos_embed"][:, :1], sd["pos_embed"][:, 1:]
        side = int(grid.shape[1] ** 0.5)
        grid = grid.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=model.grid, mode="bicubic", align_corners=False)
        sd["pos_embed"] = torch.cat([cls_tok, grid.permute(0, 2, 3, 1).flatten(1, 2)], 1)
    return model.load_state_dict(sd, strict=False)


def param_groups_lrd(model, base_lr, wd, layer_decay, num_layers=12):
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith(("patch_embed", "pos_embed")):
            layer = 0
        elif name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        else:
            layer = num_layers + 1
        no_wd = p.ndim == 1 or name == "pos_embed"
        key = (layer, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "lr": base_lr * layer_decay ** (num_layers + 1 - layer),
                           "weight_decay": 0.0 if no_wd else wd}
        groups[key]["params"].append(p)
    for g in groups.values():
        g["initial_lr"] = g["lr"]
    return list(groups.values())


def set_lr(optimizer, epoch, it, iters_per_epoch, warmup_iters=500, milestones=(170, 200)):
    step = epoch * iters_per_epoch + it
    factor = min(1.0, 0.001 + 0.999 * step / warmup_iters)
    factor *= 0.1 ** sum(epoch >= m for m in milestones)
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * factor


@torch.no_grad()
def evaluate(model, loader, dataset, device, work_dir, epoch):
    model.eval()
    out = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        heat = ((hm + hm_f) / 2).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            good = mv[n, :, 0] > 0.2
            out.append(dict(index=int(meta["index"][n]), image_id=int(meta["image_id"][n]), category_id=1,
                            keypoints=np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                            score=float(mv[n, good, 0].mean()) if good.any() else 0.0))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() != 0:
        return 0.0
    uniq = {r.pop("index"): r for part in gathered for r in part}
    path = os.path.join(work_dir, f"results_ep{epoch:03d}.json")
    with open(path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(dataset.coco, dataset.coco.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/datasets/coco")
    p.add_argument("--mae", default="weights/mae_pretrain_vit_base.pth")
    p.add_argument("--work-dir", default="/mnt/exp/vitpose_b")
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=210)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, udp=True)
    train_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_train2017.json", "train2017", train=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_val2017.json", "val2017", train=False, **kw)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 128, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    model = ViTPose()
    if not args.resume:
        msg = load_mae(model, args.mae)
        if rank == 0:
            print("MAE init:", msg, flush=True)
    model.to(device)
    optimizer = torch.optim.AdamW(param_groups_lrd(model, args.lr, 0.1, args.layer_decay), lr=args.lr,
                                  betas=(0.9, 0.999))
    model = DDP(model, device_ids=[local_rank])

    start_epoch, best_ap = 0, 0.0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt["best_ap"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, best AP {best_ap:.4f}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for it, (img, target, weight, _) in enumerate(train_dl):
            set_lr(optimizer, epoch, it, len(train_dl))
            img, target, weight = img.to(device, non_blocking=True), target.to(device, non_blocking=True), weight.to(device, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.6f} {time.time() - t0:.0f}s", flush=True)

        ap = 0.0
        if (epoch + 1) % 10 == 0:
            ap = evaluate(model, val_dl, val_ds, device, args.work_dir, epoch)
        if rank == 0:
            if ap > best_ap:
                best_ap = ap
                torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "best_ap": best_ap}, os.path.join(args.work_dir, "latest.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
