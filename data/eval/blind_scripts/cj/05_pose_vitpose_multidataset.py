"""ViTPose-B with one decoder head per keypoint dataset (COCO / AIC / MPII), jointly trained.

torchrun --nproc_per_node=8 05_pose_vitpose_multidataset.py --config configs/vitpose_b_multi.yaml
"""
import argparse
import json
import math
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IMG_W, IMG_H, HM_W, HM_H, MAX_JOINTS = 192, 256, 48, 64, 17
MEAN, STD = np.array([123.675, 116.28, 103.53], np.float32), np.array([58.395, 57.12, 57.375], np.float32)


class TopDownJson(Dataset):
    """Annotation list produced by tools/convert_to_topdown.py: one record per person box."""

    def __init__(self, ann_json, img_root, num_joints, ds_idx, train=True, sigma=2.0):
        with open(ann_json) as f:
            self.records = json.load(f)
        self.img_root, self.num_joints, self.ds_idx, self.train, self.sigma = img_root, num_joints, ds_idx, train, sigma

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_root, r["file"])), cv2.COLOR_BGR2RGB)
        x, y, w, h = r["bbox"]
        c = np.array([x + w / 2, y + h / 2], np.float32)
        w, h = (h * IMG_W / IMG_H, h) if w * IMG_H < h * IMG_W else (w, w * IMG_H / IMG_W)
        s = np.array([w, h], np.float32) * 1.25
        rot = 0.0
        if self.train:
            s *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            rot = float(np.clip(np.random.randn() * 40, -80, 80)) if np.random.rand() < 0.6 else 0.0
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, IMG_W / s[0])
        M[:, 2] += np.array([IMG_W / 2, IMG_H / 2]) - c
        patch = cv2.warpAffine(img, M, (IMG_W, IMG_H), flags=cv2.INTER_LINEAR)
        kpts = np.array(r["keypoints"], np.float32).reshape(-1, 3)
        xy = np.concatenate([kpts[:, :2], np.ones((len(kpts), 1), np.float32)], 1) @ M.T / 4.0
        target = np.zeros((MAX_JOINTS, HM_H, HM_W), np.float32)
        weight = np.zeros((MAX_JOINTS, 1), np.float32)
        gx, gy = np.arange(HM_W, dtype=np.float32), np.arange(HM_H, dtype=np.float32)[:, None]
        for j in range(self.num_joints):
            if kpts[j, 2] > 0 and 0 <= xy[j, 0] < HM_W and 0 <= xy[j, 1] < HM_H:
                target[j] = np.exp(-((gx - xy[j, 0]) ** 2 + (gy - xy[j, 1]) ** 2) / (2 * self.sigma ** 2))
                weight[j] = 1.0
        patch = (patch.astype(np.float32) - MEAN) / STD
        meta = {"center": c, "scale": s, "image_id": r.get("image_id", -1), "score": r.get("score", 1.0), "index": i}
        return torch.from_numpy(patch.transpose(2, 0, 1)), torch.from_numpy(target), torch.from_numpy(weight), self.ds_idx, meta


class ViTPose(nn.Module):
    def __init__(self, head_joints, embed_dim=768, depth=12, num_heads=12, drop_path=0.3, with_cp=True):
        super().__init__()
        self.with_cp = with_cp
        self.patch_embed = PatchEmbed(img_size=(IMG_H, IMG_W), patch_size=16, embed_dim=embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        dpr = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio=4, qkv_bias=True, drop_path=dpr[i])
                                     for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head_names = list(head_joints)
        # "simple decoder": bilinear x4, ReLU, 3x3 conv
        self.heads = nn.ModuleDict({k: nn.Conv2d(embed_dim, n, 3, padding=1) for k, n in head_joints.items()})
        self.head_joints = head_joints
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward_features(self, x):
        x = self.patch_embed(x) + self.pos_embed
        for blk in self.blocks:
            if self.with_cp and self.training:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        x = self.norm(x)
        b, n, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, IMG_H // 16, IMG_W // 16)
        return F.relu(F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=False))

    def forward(self, x, ds_idx):
        feat = self.forward_features(x)
        out = feat.new_zeros(x.size(0), MAX_JOINTS, HM_H, HM_W)
        for i, name in enumerate(self.head_names):
            sel = ds_idx == i
            if sel.any():
                out[sel, :self.head_joints[name]] = self.heads[name](feat[sel]).to(out.dtype)
        return out


def param_groups(model, weight_decay, layer_decay, num_layers):
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("blocks."):
            layer_id = int(name.split(".")[1]) + 1
        elif name.startswith(("patch_embed", "pos_embed")):
            layer_id = 0
        else:
            layer_id = num_layers + 1
        no_decay = p.ndim == 1 or name.endswith("pos_embed")
        key = (layer_id, no_decay)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": layer_decay ** (num_layers + 1 - layer_id)}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate_coco(model, loader, ann_file, out_dir, device):
    model.eval()
    preds = []
    for imgs, _, _, ds_idx, meta in loader:
        imgs, ds_idx = imgs.to(device, non_blocking=True), ds_idx.to(device)
        hm = model(imgs, ds_idx)[:, :17].float()
        n, j, h, w = hm.shape
        conf, idx = hm.flatten(2).max(dim=2)
        xy = torch.stack([idx % w, idx // w], -1).float().cpu().numpy() * 4.0
        conf = conf.cpu().numpy()
        for k in range(n):
            c, s = meta["center"][k].numpy(), meta["scale"][k].numpy()
            img_xy = (xy[k] - np.array([IMG_W / 2, IMG_H / 2])) * (s[0] / IMG_W) + c
            kp = np.concatenate([img_xy, conf[k][:, None]], 1)
            preds.append({"index": int(meta["index"][k]), "image_id": int(meta["image_id"][k]), "category_id": 1,
                          "keypoints": kp.reshape(-1).tolist(), "score": float(meta["score"][k]) * float(conf[k].mean())})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, preds)
    ap = torch.zeros(1, device=device)
    if dist.get_rank() == 0:
        merged = list({p["index"]: p for part in gathered for p in part}.values())
        res_file = os.path.join(out_dir, "coco_val_keypoints.json")
        with open(res_file, "w") as f:
            json.dump([{k: v for k, v in p.items() if k != "index"} for p in merged], f)
        gt = COCO(ann_file)
        ev = COCOeval(gt, gt.loadRes(res_file), "keypoints")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        ap[0] = ev.stats[0]
    dist.broadcast(ap, 0)
    return ap.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    head_joints = {d["name"]: d["num_joints"] for d in cfg["datasets"]}
    train_set = ConcatDataset([TopDownJson(d["train_ann"], d["img_root"], d["num_joints"], i)
                               for i, d in enumerate(cfg["datasets"])])
    val_set = TopDownJson(cfg["coco_val"]["det_ann"], cfg["coco_val"]["img_root"], 17, 0, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=train_sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.get("workers", 8), pin_memory=True)

    model = ViTPose(head_joints, with_cp=cfg.get("with_cp", True))
    if cfg.get("pretrained"):
        state = torch.load(cfg["pretrained"], map_location="cpu")
        missing, unexpected = model.load_state_dict(state.get("model", state), strict=False)
        if rank == 0:
            print(f"loaded MAE weights, missing={len(missing)} unexpected={len(unexpected)}")
    model.to(device)
    # a batch does not always contain all three datasets, so some heads may get no gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    global_batch = cfg["batch_per_gpu"] * world
    base_lr = cfg["lr"] * global_batch / 512
    optimizer = torch.optim.AdamW(param_groups(model.module, 0.1, cfg.get("layer_decay", 0.75), 12),
                                  lr=base_lr, betas=(0.9, 0.999))
    total_iters = cfg["epochs"] * len(train_loader)
    warmup_iters = 500

    def lr_at(it):
        if it < warmup_iters:
            return base_lr * (0.001 + 0.999 * it / warmup_iters)
        return base_lr * 0.5 * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))

    os.makedirs(cfg["work_dir"], exist_ok=True)
    it, best = 0, 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for imgs, target, weight, ds_idx, _ in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(it) * g["lr_scale"]
            imgs, target = imgs.to(device, non_blocking=True), target.to(device, non_blocking=True)
            weight, ds_idx = weight.to(device, non_blocking=True), ds_idx.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(imgs, ds_idx)
            loss = (((pred.float() - target) ** 2) * weight[..., None]).mean() * 0.5
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {it}/{total_iters} lr {lr_at(it):.2e} loss {l.item():.6f}", flush=True)
            it += 1

        if (epoch + 1) % cfg.get("eval_interval", 10) == 0:
            ap_val = evaluate_coco(model.module, val_loader, cfg["coco_val"]["gt_ann"], cfg["work_dir"], device)
            if rank == 0:
                print(f"epoch {epoch + 1}: COCO val AP {ap_val:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "ap": ap_val},
                           os.path.join(cfg["work_dir"], "latest.pth"))
                if ap_val > best:
                    best = ap_val
                    torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "ap": ap_val},
                               os.path.join(cfg["work_dir"], "best_coco_ap.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
