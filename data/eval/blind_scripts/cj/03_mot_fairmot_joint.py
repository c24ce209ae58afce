"""FairMOT-style joint detection + re-ID embedding training on MOT17 + CrowdHuman.

CrowdHuman has boxes but no track identities (id = -1 in the label files), MOT17 has both.

torchrun --nproc_per_node=4 03_mot_fairmot_joint.py --data-cfg cfg/mot17_ch.json
"""
import argparse
import json
import math
import os
import os.path as osp

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MAX_OBJS = 500


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-cfg", default="cfg/mot17_ch.json")
    p.add_argument("--save-dir", default="exp/fairmot_r34")
    p.add_argument("--input-wh", type=int, nargs=2, default=[1088, 608])
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr-step", type=int, default=20)
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def gaussian_radius(h, w, min_overlap=0.7):
    a, b, c = 4, 2 * (h + w), (w * h * (1 - min_overlap)) / (1 + min_overlap)
    return max(0, int((b + math.sqrt(b ** 2 - 4 * a * c)) / 2 / 2 * 0.8))


def draw_gaussian(hm, center, radius):
    d = 2 * radius + 1
    ys, xs = np.ogrid[-radius:radius + 1, -radius:radius + 1]
    g = np.exp(-(xs * xs + ys * ys) / (2 * (d / 6) ** 2))
    x, y = int(center[0]), int(center[1])
    H, W = hm.shape
    l, r, t, b = min(x, radius), min(W - x, radius + 1), min(y, radius), min(H - y, radius + 1)
    np.maximum(hm[y - t:y + b, x - l:x + r], g[radius - t:radius + b, radius - l:radius + r],
               out=hm[y - t:y + b, x - l:x + r])


class JointDataset(Dataset):
    """Reads a list of image paths; labels live next to them under labels_with_ids/."""

    def __init__(self, root, list_file, id_offset, input_wh, down_ratio=4):
        with open(list_file) as f:
            self.img_files = [osp.join(root, l.strip()) for l in f if l.strip()]
        self.label_files = [p.replace("images", "labels_with_ids").rsplit(".", 1)[0] + ".txt"
                            for p in self.img_files]
        self.id_offset = id_offset
        self.w, self.h = input_wh
        self.down = down_ratio

    def __len__(self):
        return len(self.img_files)

    def __getitem__(self, idx):
        img = cv2.imread(self.img_files[idx])
        h0, w0 = img.shape[:2]
        img = cv2.resize(img, (self.w, self.h))
        labels = np.loadtxt(self.label_files[idx], dtype=np.float32).reshape(-1, 6)
        if np.random.rand() < 0.5:
            img = img[:, ::-1]
            labels[:, 2] = 1 - labels[:, 2]
        ow, oh = self.w // self.down, self.h // self.down
        hm = np.zeros((1, oh, ow), np.float32)
        wh = np.zeros((MAX_OBJS, 4), np.float32)
        reg = np.zeros((MAX_OBJS, 2), np.float32)
        ind = np.zeros((MAX_OBJS,), np.int64)
        mask = np.zeros((MAX_OBJS,), np.float32)
        ids = np.full((MAX_OBJS,), -1, np.int64)
        for k, (_, tid, cx, cy, bw, bh) in enumerate(labels[:MAX_OBJS]):
            cx, cy, bw, bh = cx * ow, cy * oh, bw * ow, bh * oh
            if bw <= 0 or bh <= 0 or not (0 <= cx < ow and 0 <= cy < oh):
                continue
            ct = np.array([cx, cy], np.float32)
            ct_int = ct.astype(np.int32)
            draw_gaussian(hm[0], ct_int, gaussian_radius(math.ceil(bh), math.ceil(bw)))
            x1, y1, x2, y2 = cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2
            wh[k] = [ct_int[0] - x1, ct_int[1] - y1, x2 - ct_int[0], y2 - ct_int[1]]
            reg[k] = ct - ct_int
            ind[k] = ct_int[1] * ow + ct_int[0]
            mask[k] = 1
            ids[k] = int(tid) + self.id_offset if tid >= 0 else -1
        img = np.ascontiguousarray(img[:, :, ::-1]).astype(np.float32) / 255.0
        return {"img": torch.from_numpy(img.transpose(2, 0, 1)), "hm": hm, "wh": wh, "reg": reg,
                "ind": ind, "mask": mask, "ids": ids}


class FairMOT(nn.Module):
    def __init__(self, num_ids, emb_dim=128, head_ch=256):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.lat = nn.ModuleList([nn.Conv2d(c, 64, 1) for c in (64, 128, 256, 512)])

        def head(out_ch, bias=0.0):
            h = nn.Sequential(nn.Conv2d(64, head_ch, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(head_ch, out_ch, 1))
            nn.init.constant_(h[-1].bias, bias)
            return h

        self.hm = head(1, -2.19)
        self.wh = head(4)
        self.reg = head(2)
        self.id_head = head(emb_dim)
        self.classifier = nn.Linear(emb_dim, num_ids)
        self.s_det = nn.Parameter(torch.tensor(-1.85))
        self.s_id = nn.Parameter(torch.tensor(-1.05))

    def forward(self, x):
        feats, y = [], self.stem(x)
        for layer in self.layers:
            y = layer(y)
            feats.append(y)
        out = self.lat[3](feats[3])
        for i in (2, 1, 0):
            out = F.interpolate(out, size=feats[i].shape[-2:], mode="nearest") + self.lat[i](feats[i])
        return {"hm": self.hm(out), "wh": self.wh(out), "reg": self.reg(out), "id": self.id_head(out)}


def focal_loss(pred, gt):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg_w = torch.pow(1 - gt, 4)
    pos_loss = (torch.log(pred) * torch.pow(1 - pred, 2) * pos).sum()
    neg_loss = (torch.log(1 - pred) * torch.pow(pred, 2) * neg_w * (1 - pos)).sum()
    num_pos = pos.sum()
    return -neg_loss if num_pos == 0 else -(pos_loss + neg_loss) / num_pos


def gather_feat(fmap, ind):
    b, c = fmap.shape[:2]
    fmap = fmap.view(b, c, -1).permute(0, 2, 1)
    return fmap.gather(1, ind.unsqueeze(2).expand(-1, -1, c))


def compute_loss(model, out, batch, num_ids):
    core = model.module
    hm_loss = focal_loss(out["hm"], batch["hm"])
    m = batch["mask"].unsqueeze(2)
    wh_loss = F.l1_loss(gather_feat(out["wh"], batch["ind"]) * m, batch["wh"] * m, reduction="sum") / (m.sum() * 4 + 1e-4)
    off_loss = F.l1_loss(gather_feat(out["reg"], batch["ind"]) * m, batch["reg"] * m, reduction="sum") / (m.sum() * 2 + 1e-4)
    det_loss = hm_loss + 0.1 * wh_loss + off_loss

    id_loss = torch.zeros((), device=hm_loss.device)
    id_target = batch["ids"]
    id_mask = (batch["mask"] > 0) & (id_target >= 0)
    if id_mask.any():
        emb = gather_feat(out["id"], batch["ind"])[id_mask]
        emb = math.sqrt(2) * math.log(num_ids - 1) * F.normalize(emb, dim=1)
        id_loss = F.cross_entropy(core.classifier(emb), id_target[id_mask])

    loss = torch.exp(-core.s_det) * det_loss + torch.exp(-core.s_id) * id_loss + (core.s_det + core.s_id)
    return 0.5 * loss, {"hm": hm_loss.detach(), "wh": wh_loss.detach(), "off": off_loss.detach(), "id": id_loss.detach()}


@torch.no_grad()
def evaluate(model, loader, num_ids, device):
    model.eval()
    meter = torch.zeros(5, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        _, stats = compute_loss(model, model.module(batch["img"]), batch, num_ids)
        meter += torch.stack([stats["hm"], stats["wh"], stats["off"], stats["id"], torch.ones((), device=device)])
    dist.all_reduce(meter)
    return (meter[:4] / meter[4]).tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.data_cfg) as f:
        cfg = json.load(f)
    # identities of every source are stacked into one label space
    datasets, offset = [], 0
    for name, spec in cfg["train"].items():
        datasets.append(JointDataset(cfg["root"], spec["list"], offset, args.input_wh))
        offset += spec["num_ids"]
    num_ids = offset
    train_set = ConcatDataset(datasets)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_set = JointDataset(cfg["root"], cfg["val"]["list"], 0, args.input_wh)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = FairMOT(num_ids, args.emb_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world * args.batch_size / 32)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_step, 0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"images {len(train_set)}  identities {num_ids}  world {world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(5, device=device)
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["img"])
            loss, stats = compute_loss(model, out, batch, num_ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([stats["hm"], stats["wh"], stats["off"], stats["id"], torch.ones((), device=device)])
            if it % 50 == 0 and rank == 0:
                print(f"[{epoch}][{it}/{len(loader)}] loss {loss.item():.3f} hm {stats['hm']:.3f} "
                      f"id {stats['id']:.3f}", flush=True)
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            hm, wh, off, idl = (meter[:4] / meter[4]).tolist()
            print(f"epoch {epoch}: hm {hm:.4f} wh {wh:.4f} off {off:.4f} id {idl:.4f}", flush=True)
        if (epoch + 1) % 5 == 0:
            v_hm, v_wh, v_off, _ = evaluate(model, val_loader, num_ids, device)
            if rank == 0:
                print(f"val epoch {epoch}: hm {v_hm:.4f} wh {v_wh:.4f} off {v_off:.4f}", flush=True)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, osp.join(args.save_dir, "model_last.pth"))
            if (epoch + 1) % 5 == 0:
                torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict()},
                           osp.join(args.save_dir, f"model_{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
