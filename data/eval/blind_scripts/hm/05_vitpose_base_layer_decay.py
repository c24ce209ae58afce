"""ViTPose-B (simple decoder) on COCO, MAE-pretrained ViT-B/16, 256x192 input.

torchrun --nnodes=1 --nproc_per_node=8 05_vitpose_base_layer_decay.py --data data/coco --out runs/vitpose_b
"""
import argparse
import json
import math
import os
import time
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from posedata import TopDownCocoDataset, decode_heatmaps, FLIP_INDEX


class ViTPose(nn.Module):
    def __init__(self, backbone="vit_base_patch16_224.mae", img_size=(256, 192), num_joints=17, drop_path=0.3):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, img_size=img_size, num_classes=0,
                                          global_pool="", drop_path_rate=drop_path)
        self.grid = (img_size[0] // 16, img_size[1] // 16)
        dim = self.backbone.embed_dim
        # "simple" decoder of ViTPose: 4x bilinear upsample + 3x3 conv
        self.head = nn.Sequential(nn.ReLU(), nn.Upsample(scale_factor=4, mode="bilinear", align_corners=False),
                                  nn.Conv2d(dim, num_joints, 3, padding=1))

    def forward(self, x):
        tokens = self.backbone.forward_features(x)[:, self.backbone.num_prefix_tokens:]
        b, n, c = tokens.shape
        feat = tokens.transpose(1, 2).reshape(b, c, *self.grid)
        return self.head(feat)


def layer_decay_param_groups(model, base_lr, weight_decay, layer_decay):
    skip = model.backbone.no_weight_decay()
    num_layers = len(model.backbone.blocks) + 1
    groups = defaultdict(lambda: {"params": []})
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("backbone."):
            sub = name[len("backbone."):]
            if sub.startswith(("cls_token", "pos_embed", "patch_embed")):
                layer_id = 0
            elif sub.startswith("blocks."):
                layer_id = int(sub.split(".")[1]) + 1
            else:
                layer_id = num_layers
        else:
            layer_id = num_layers
        no_wd = p.ndim == 1 or name.endswith(".bias") or name.split(".", 1)[-1] in skip
        key = (layer_id, no_wd)
        g = groups[key]
        g["lr"] = base_lr * layer_decay ** (num_layers - layer_id)
        g["weight_decay"] = 0.0 if no_wd else weight_decay
        g["params"].append(p)
    return list(groups.values())


def keypoint_loss(pred, target, weight):
    return F.mse_loss(pred * weight[..., None], target * weight[..., None]) * 0.5


def lr_lambda_factory(warmup_iters, iters_per_epoch, milestones):
    def f(it):
        warm = min(1.0, 0.001 + 0.999 * it / warmup_iters)
        epoch = it // iters_per_epoch
        return warm * (0.1 ** sum(epoch >= m for m in milestones))
    return f


@torch.no_grad()
def run_eval(model, loader, coco, out_dir, epoch, rank, world):
    model.eval()
    local = []
    for batch in loader:
        img = batch["img"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hm = model(img)
            hm_flip = model(img.flip(3)).flip(3)[:, FLIP_INDEX]
        hm = ((hm + hm_flip) * 0.5).float().cpu().numpy()
        kpts = decode_heatmaps(hm, batch["center"].numpy(), batch["scale"].numpy())
        for i in range(kpts.shape[0]):
            vis = kpts[i, :, 2] > 0.2
            s = float(kpts[i, vis, 2].mean()) if vis.any() else 0.0
            local.append({"idx": int(batch["idx"][i]), "image_id": int(batch["image_id"][i]), "category_id": 1,
                          "keypoints": kpts[i].reshape(-1).tolist(), "score": s * float(batch["bbox_score"][i])})
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank != 0:
        return None
    uniq = {r["idx"]: r for part in gathered for r in part}
    results = [{k: v for k, v in r.items() if k != "idx"} for r in uniq.values()]
    path = os.path.join(out_dir, f"results_epoch{epoch}.json")
    with open(path, "w") as f:
        json.dump(results, f)
    ev = COCOeval(coco, coco.loadRes(path), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/coco")
    ap.add_argument("--out", default="runs/vitpose_b")
    ap.add_argument("--batch", type=int, default=64, help="per GPU; ViTPose uses 8x64")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--layer-decay", type=float, default=0.75)
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--milestones", type=int, nargs="+", default=[170, 200])
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds = TopDownCocoDataset(os.path.join(args.data, "annotations/person_keypoints_train2017.json"),
                                  os.path.join(args.data, "train2017"), img_size=(256, 192), train=True)
    val_ds = TopDownCocoDataset(os.path.join(args.data, "annotations/person_keypoints_val2017.json"),
                                os.path.join(args.data, "val2017"), img_size=(256, 192), train=False,
                                bbox_file=os.path.join(args.data, "person_detection_results/COCO_val2017_detections_AP_H_56_person.json"))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch, sampler=train_sampler, num_workers=10, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 128, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=6,
                            pin_memory=True)

    model = ViTPose().cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(layer_decay_param_groups(model, args.lr, args.wd, args.layer_decay),
                                  betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_factory(500, len(train_loader), args.milestones))

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"], ckpt.get("best", 0.0)

    coco_val = COCO(os.path.join(args.data, "annotations/person_keypoints_val2017.json")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            img = batch["img"].cuda(non_blocking=True)
            target = batch["target"].cuda(non_blocking=True)
            weight = batch["target_weight"].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            loss = keypoint_loss(out.float(), target, weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.6f} "
                      f"lr {optimizer.param_groups[-1]['lr']:.3e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = run_eval(model, val_loader, coco_val, args.out, epoch, rank, world)
            if rank == 0:
                print(f"epoch {epoch}: AP {ap:.4f}", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch + 1, "best": best},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
