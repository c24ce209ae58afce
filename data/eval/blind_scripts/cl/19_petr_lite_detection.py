"""PETR-lite: 3D position-embedding transformer for multi-camera 3D detection (nuScenes).

Object queries attend to image features that carry a 3D position embedding built
from camera frustum points; Hungarian matching per sample (variable number of GT boxes).

    torchrun --nproc_per_node=8 19_petr_lite_detection.py --work-dir /mnt/shared/petr_lite_r50
"""
import argparse
import os
import pickle
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import sigmoid_focal_loss

NUM_CLASSES = 10
PC_RANGE = torch.tensor([-61.2, -61.2, -10.0, 61.2, 61.2, 10.0])
IMG_H, IMG_W = 320, 800


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/mnt/shared/nuscenes")
    p.add_argument("--work-dir", default="/mnt/shared/petr_lite_r50")
    p.add_argument("--num-queries", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-4, help="for 8 GPUs x 1 sample")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--auto-resume", action="store_true")
    return p.parse_args()


class PETRData(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"petr_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.root = root
        self.mean = torch.tensor([103.53, 116.28, 123.675]).view(3, 1, 1)
        self.std = torch.tensor([57.375, 57.12, 58.395]).view(3, 1, 1)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, img2lidar = [], []
        for cam in info["cams"]:
            im = Image.open(os.path.join(self.root, cam["data_path"])).convert("RGB")
            s = np.diag([IMG_W / im.width, IMG_H / im.height, 1.0, 1.0]).astype(np.float32)
            im = torch.from_numpy(np.asarray(im.resize((IMG_W, IMG_H)), dtype=np.float32)).permute(2, 0, 1)
            imgs.append((im.flip(0) - self.mean) / self.std)  # BGR, caffe-style normalisation
            img2lidar.append(torch.from_numpy(np.linalg.inv(s @ np.asarray(cam["lidar2img"], dtype=np.float32))))
        boxes = torch.as_tensor(info["gt_boxes"], dtype=torch.float32).reshape(-1, 9)  # x y z w l h yaw vx vy
        labels = torch.as_tensor(info["gt_labels"], dtype=torch.long).reshape(-1)
        return torch.stack(imgs), torch.stack(img2lidar), boxes, labels


def collate(batch):
    imgs, i2l, boxes, labels = zip(*batch)
    return torch.stack(imgs), torch.stack(i2l), list(boxes), list(labels)


def encode_boxes(b):
    return torch.cat([b[:, :3], b[:, 3:6].log(), b[:, 6:7].sin(), b[:, 6:7].cos(), b[:, 7:9]], -1)


class PETRLite(nn.Module):
    def __init__(self, num_queries=600, d=256, depth_bins=64):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.D = depth_bins
        idx = torch.arange(depth_bins, dtype=torch.float)
        self.register_buffer("depths", 1.0 + (61.2 - 1.0) / (depth_bins * (depth_bins + 1)) * idx * (idx + 1),
                             persistent=False)  # linear-increasing discretisation
        self.register_buffer("pc_range", PC_RANGE.clone(), persistent=False)
        self.pos3d = nn.Sequential(nn.Conv2d(depth_bins * 3, 4 * d, 1), nn.ReLU(True), nn.Conv2d(4 * d, d, 1))
        self.query_ref = nn.Embedding(num_queries, 3)
        self.query_embed = nn.Sequential(nn.Linear(3, d), nn.ReLU(True), nn.Linear(d, d))
        layer = nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 6)
        self.cls_head = nn.Linear(d, NUM_CLASSES)
        self.reg_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, 10))
        nn.init.uniform_(self.query_ref.weight, -3.0, 3.0)
        nn.init.constant_(self.cls_head.bias, -4.6)

    def position_embedding(self, img2lidar, h, w):
        B, N = img2lidar.shape[:2]
        dev = img2lidar.device
        u = (torch.arange(w, device=dev).float() + 0.5) * IMG_W / w
        v = (torch.arange(h, device=dev).float() + 0.5) * IMG_H / h
        vv, uu = torch.meshgrid(v, u, indexing="ij")
        d = self.depths.view(-1, 1, 1).expand(-1, h, w)
        pts = torch.stack([uu * d, vv * d, d, torch.ones_like(d)], -1)  # (D, h, w, 4)
        pts3d = torch.einsum("bnij,dhwj->bndhwi", img2lidar, pts)[..., :3]
        pts3d = (pts3d - self.pc_range[:3]) / (self.pc_range[3:] - self.pc_range[:3])
        pts3d = pts3d.permute(0, 1, 2, 5, 3, 4).reshape(B * N, self.D * 3, h, w)
        return self.pos3d(pts3d.clamp(0, 1) * 2 - 1)

    def forward(self, imgs, img2lidar):
        B, N = imgs.shape[:2]
        f = self.input_proj(self.backbone(imgs.flatten(0, 1)))
        h, w = f.shape[-2:]
        mem = (f + self.position_embedding(img2lidar, h, w)).view(B, N, -1, h * w)
        mem = mem.permute(0, 1, 3, 2).reshape(B, N * h * w, -1)
        ref = self.query_ref.weight.sigmoid()
        q = self.query_embed(ref).unsqueeze(0).expand(B, -1, -1)
        hs = self.decoder(q, mem)
        reg = self.reg_head(hs)
        center = ref * (self.pc_range[3:] - self.pc_range[:3]) + self.pc_range[:3]
        reg = torch.cat([reg[..., :3] + center, reg[..., 3:]], -1)
        return self.cls_head(hs), reg


@torch.no_grad()
def hungarian(cls_logits, reg, gt_boxes, gt_labels):
    matches = []
    for c, r, gb, gl in zip(cls_logits, reg, gt_boxes, gt_labels):
        if len(gl) == 0:
            matches.append((torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)))
            continue
        p = c.sigmoid()[:, gl]
        cost_cls = 2.0 * ((1 - p) ** 2 * -(p + 1e-8).log()) - 0.25 * (p ** 2 * -(1 - p + 1e-8).log())
        cost_reg = torch.cdist(r[:, :8], encode_boxes(gb)[:, :8], p=1)
        qi, gi = linear_sum_assignment((cost_cls + 0.25 * cost_reg).float().cpu().numpy())
        matches.append((torch.as_tensor(qi, dtype=torch.long), torch.as_tensor(gi, dtype=torch.long)))
    return matches


def set_loss(cls_logits, reg, gt_boxes, gt_labels, world):
    matches = hungarian(cls_logits, reg, gt_boxes, gt_labels)
    num_gt = torch.tensor(float(sum(len(l) for l in gt_labels)), device=reg.device)
    dist.all_reduce(num_gt)
    num_gt = (num_gt / world).clamp(min=1.0)
    tgt_cls = torch.zeros_like(cls_logits)
    l1 = reg.sum() * 0.0
    for b, (qi, gi) in enumerate(matches):
        tgt_cls[b, qi.to(reg.device), gt_labels[b][gi].to(reg.device)] = 1.0
        if len(qi):
            l1 = l1 + F.l1_loss(reg[b, qi.to(reg.device)], encode_boxes(gt_boxes[b][gi]).to(reg.device), reduction="sum")
    focal = sigmoid_focal_loss(cls_logits, tgt_cls, alpha=0.25, gamma=2.0, reduction="sum")
    return 2.0 * focal / num_gt + 0.25 * l1 / num_gt


def save_checkpoint(state, work_dir, epoch):
    path = os.path.join(work_dir, f"epoch_{epoch}.pth")
    torch.save(state, path)
    shutil.copyfile(path, os.path.join(work_dir, "latest.pth"))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    os.makedirs(args.work_dir, exist_ok=True)

    train_set, val_set = PETRData(args.data_root, "train"), PETRData(args.data_root, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), args.batch_size,
                            collate_fn=collate, num_workers=args.workers)

    net = PETRLite(args.num_queries).to(dev)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world * args.batch_size / 8
    param_groups = [{"params": [p for n, p in net.named_parameters() if n.startswith("backbone") and p.requires_grad],
                     "lr": lr * 0.1},
                    {"params": [p for n, p in net.named_parameters() if not n.startswith("backbone")]}]
    opt = torch.optim.AdamW(param_groups, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_loader), eta_min=lr * 1e-3)

    start = 0
    latest = os.path.join(args.work_dir, "latest.pth")
    if args.auto_resume and os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, i2l, boxes, labels) in enumerate(train_loader):
            imgs, i2l = imgs.to(dev, non_blocking=True), i2l.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                cls_logits, reg = model(imgs, i2l)
            loss = set_loss(cls_logits.float(), reg.float(), boxes, labels, world)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {it}/{len(train_loader)} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[1]:.2e} ({time.time() - t0:.0f}s)", flush=True)

        net.eval()
        val = torch.zeros(2, device=dev)
        with torch.no_grad():
            for imgs, i2l, boxes, labels in val_loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    c, r = net(imgs.to(dev), i2l.to(dev))
                matches = hungarian(c.float(), r.float(), boxes, labels)
                for b, (qi, gi) in enumerate(matches):
                    if len(qi):
                        err = torch.norm(r[b, qi.to(dev), :2].float() - boxes[b][gi, :2].to(dev), dim=-1)
                        val += torch.stack([err.sum(), torch.tensor(float(len(qi)), device=dev)])
        dist.all_reduce(val)
        if rank == 0:
            print(f"epoch {epoch}: matched centre error {(val[0] / val[1].clamp(min=1)).item():.3f} m", flush=True)

        save_checkpoint({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "epoch": epoch}, args.work_dir, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
