"""ViTPose-S for the real-time player tracker (simple decoder, 256x192).

Small ViT, layer-wise lr decay, fp16 AMP and non-reentrant activation
checkpointing so that batch 128/GPU fits on the L40S boxes.

    torchrun --nproc_per_node=4 vitpose_s_lld.py --data /mnt/datasets/coco --work-dir /mnt/exp/vitpose_s
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
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
MAE_S_URL = "https://models.sportpose.internal/mae/mae_pretrain_vit_small.pth"


class ViTPoseS(nn.Module):
    def __init__(self, img_size=(256, 192), dim=384, depth=12, heads=12, num_joints=17, drop_path=0.1,
                 grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=16, in_chans=3, embed_dim=dim)
        self.grid = (img_size[0] // 16, img_size[1] // 16)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1] + 1, dim))
        rates = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList(Block(dim, heads, 4.0, qkv_bias=True, drop_path=r) for r in rates)
        self.last_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Conv2d(dim, num_joints, 3, padding=1)

    def no_weight_decay(self):
        return {"pos_embed"}

    def forward(self, x):
        x = self.patch_embed(x) + self.pos_embed[:, 1:] + self.pos_embed[:, :1]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.last_norm(x)
        b, _, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, *self.grid)
        x = F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=False)
        return self.head(F.relu(x))


def lld_param_groups(model, lr, wd, decay, skip):
    depth = len(model.blocks)
    groups = {}
    for name, p in model.named_parameters():
        if name.startswith(("patch_embed", "pos_embed")):
            lid = 0
        elif name.startswith("blocks."):
            lid = int(name.split(".")[1]) + 1
        else:
            lid = depth + 1
        no_decay = p.ndim == 1 or name in skip
        g = groups.setdefault((lid, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else wd,
                                                "lr": lr * decay ** (depth + 1 - lid)})
        g["params"].append(p)
    return list(groups.values())


def load_mae(model, rank):
    # rank 0 downloads into the hub cache, the rest read the finished file
    if rank == 0:
        torch.hub.load_state_dict_from_url(MAE_S_URL, map_location="cpu", progress=False)
    dist.barrier()
    sd = torch.hub.load_state_dict_from_url(MAE_S_URL, map_location="cpu", progress=False)
    sd = sd.get("model", sd)
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if k.startswith(("patch_embed", "blocks", "pos_embed"))}
    if sd["pos_embed"].shape != model.pos_embed.shape:
        cls_pe, grid_pe = sd["pos_embed"][:, :1], sd["pos_embed"][:, 1:]
        s = int(grid_pe.shape[1] ** 0.5)
        grid_pe = F.interpolate(grid_pe.reshape(1, s, s, -1).permute(0, 3, 1, 2), size=model.grid, mode="bicubic")
        sd["pos_embed"] = torch.cat([cls_pe, grid_pe.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)
    return model.load_state_dict(sd, strict=False)


@torch.no_grad()
def evaluate(model, loader, ds, device, path):
    model.eval()
    rows = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            hm = model(img).float()
            hm_f = model(img.flip(3)).float()
        hm_f = torch.from_numpy(flip_back(hm_f.cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        heat = (0.5 * (hm + hm_f)).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            ok = mv[n, :, 0] > 0.2
            rows.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                         "score": float(mv[n, ok, 0].mean()) if ok.any() else 0.0})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    result = torch.zeros(1, device=device)
    if dist.get_rank() == 0:
        uniq = {r.pop("index"): r for part in gathered for r in part}
        with open(path, "w") as f:
            json.dump(list(uniq.values()), f)
        E = COCOeval(ds.coco, ds.coco.loadRes(path), "keypoints")
        E.params.useSegm = None
        E.evaluate(); E.accumulate(); E.summarize()
        result[0] = E.stats[0]
    dist.broadcast(result, 0)
    return result.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/datasets/coco")
    ap.add_argument("--work-dir", default="/mnt/exp/vitpose_s")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--layer-decay", type=float, default=0.75)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, udp=True)
    train_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_train2017.json", "train2017", train=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_val2017.json", "val2017", train=False, **kw)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    model = ViTPoseS()
    if not args.resume:
        load_mae(model, rank)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    # reference recipe: 512 images / step at lr 5e-4
    peak_lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(lld_param_groups(model.module, peak_lr, 0.1, args.layer_decay,
                                                   model.module.no_weight_decay()), betas=(0.9, 0.999))
    for g in optimizer.param_groups:
        g["initial_lr"] = g["lr"]
    scaler = torch.cuda.amp.GradScaler()
    warmup = 500

    start_epoch, best, step = 0, 0.0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best, step = ckpt["epoch"] + 1, ckpt["best"], ckpt["step"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        m = torch.zeros(2, device=device)
        decay = 0.1 ** sum(epoch >= e for e in (170, 200))
        for img, target, weight, _ in train_dl:
            warm = min(1.0, (step + 1) / warmup)
            for g in optimizer.param_groups:
                g["lr"] = g["initial_lr"] * warm * decay
            img, target, weight = img.to(device, non_blocking=True), target.to(device, non_blocking=True), weight.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.float().view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            m += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
        dist.all_reduce(m)
        if rank == 0:
            print(f"ep {epoch} loss {(m[0] / m[1]).item():.6f} lr {optimizer.param_groups[-1]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0:
            ap_val = evaluate(model, val_dl, val_ds, device, os.path.join(args.work_dir, "val_results.json"))
            if ap_val > best:
                best = ap_val
                if rank == 0:
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))
            if rank == 0:
                print(f"ep {epoch} AP {ap_val:.4f} best {best:.4f}", flush=True)
        if rank == 0:
            torch.save({"epoch": epoch, "step": step, "best": best, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.work_dir, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
