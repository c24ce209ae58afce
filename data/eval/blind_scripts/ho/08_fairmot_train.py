"""FairMOT-style one-shot tracker: CenterNet detection + re-ID embedding branch.

Data follows the JDE layout: a list file of image paths and, for every image, a
labels_with_ids/*.txt with "cls id cx cy w h" (normalised) per row.
"""
import argparse
import datetime
import math
import os
import pickle

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-cfg", default="data/mix_mot17_half.txt", help="one image list file per line")
    ap.add_argument("--val-list", default="data/mot17.val_half")
    ap.add_argument("--data-root", default="/data/jde")
    ap.add_argument("--exp", default="fairmot_r34_mix")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=6, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--reid-dim", type=int, default=128)
    ap.add_argument("--resume", default="")
    ap.add_argument("--wandb-project", default="mot-fairmot")
    return ap.parse_args()


def build_index(list_files, root):
    """Reads every label file once; maps (dataset, track id) to a global identity index."""
    items, id_offset = [], 0
    for lf in list_files:
        with open(lf) as f:
            paths = [os.path.join(root, l.strip()) for l in f if l.strip()]
        max_id = -1
        for p in paths:
            lp = p.replace("images", "labels_with_ids").rsplit(".", 1)[0] + ".txt"
            lab = np.loadtxt(lp, dtype=np.float32, ndmin=2) if os.path.exists(lp) else np.zeros((0, 6), np.float32)
            if len(lab):
                max_id = max(max_id, int(lab[:, 1].max()))
                lab[:, 1] = np.where(lab[:, 1] >= 0, lab[:, 1] + id_offset, -1)
            items.append((p, lab))
        id_offset += max_id + 1
    return items, id_offset


def cached_index(list_files, root, cache_path, rank):
    if rank == 0 and not os.path.exists(cache_path):
        items, n_ids = build_index(list_files, root)
        tmp = cache_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump((items, n_ids), f)
        os.replace(tmp, cache_path)
    dist.barrier()
    with open(cache_path, "rb") as f:
        return pickle.load(f)


def gaussian_radius(h, w, min_overlap=0.7):
    b = h + w
    c = w * h * (1 - min_overlap) / (1 + min_overlap)
    return (b - math.sqrt(b * b - 4 * c)) / 2


class JDEDataset(Dataset):
    def __init__(self, items, size=(608, 1088), max_objs=500, down=4, train=True):
        self.items, self.size, self.max_objs, self.down, self.train = items, size, max_objs, down, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, lab = self.items[i]
        img = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
        H, W = self.size
        img = cv2.resize(img, (W, H))
        lab = lab.copy()
        if self.train and np.random.rand() < 0.5:
            img = img[:, ::-1]
            lab[:, 2] = 1 - lab[:, 2]
        oh, ow = H // self.down, W // self.down
        hm = np.zeros((1, oh, ow), np.float32)
        wh = np.zeros((self.max_objs, 4), np.float32)
        reg = np.zeros((self.max_objs, 2), np.float32)
        ind = np.zeros(self.max_objs, np.int64)
        mask = np.zeros(self.max_objs, np.uint8)
        ids = np.full(self.max_objs, -1, np.int64)
        yy, xx = np.ogrid[:oh, :ow]
        for k, (_, tid, cx, cy, bw, bh) in enumerate(lab[: self.max_objs]):
            cx, cy, bw, bh = cx * ow, cy * oh, bw * ow, bh * oh
            if bw <= 0 or bh <= 0 or not (0 <= cx < ow and 0 <= cy < oh):
                continue
            r = max(0, int(gaussian_radius(math.ceil(bh), math.ceil(bw))))
            ci, cj = int(cx), int(cy)
            g = np.exp(-((xx - ci) ** 2 + (yy - cj) ** 2) / (2 * ((2 * r + 1) / 6) ** 2))
            hm[0] = np.maximum(hm[0], g)
            wh[k] = (cx - (cx - bw / 2), cy - (cy - bh / 2), (cx + bw / 2) - cx, (cy + bh / 2) - cy)
            reg[k] = (cx - ci, cy - cj)
            ind[k] = cj * ow + ci
            mask[k] = 1
            ids[k] = int(tid)
        x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float() / 255.0
        return x, {"hm": torch.from_numpy(hm), "wh": torch.from_numpy(wh), "reg": torch.from_numpy(reg),
                   "ind": torch.from_numpy(ind), "mask": torch.from_numpy(mask), "ids": torch.from_numpy(ids)}


class CenterNetReID(nn.Module):
    def __init__(self, reid_dim):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.body = nn.Sequential(*list(r.children())[:-2])
        up = []
        ch = 512
        for out in (256, 128, 64):
            up += [nn.ConvTranspose2d(ch, out, 4, 2, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            ch = out
        self.up = nn.Sequential(*up)

        def head(o):
            return nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, o, 1))

        self.hm, self.wh, self.reg, self.id = head(1), head(4), head(2), head(reid_dim)
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, x):
        f = self.up(self.body(x))
        return {"hm": self.hm(f), "wh": self.wh(f), "reg": self.reg(f), "id": self.id(f)}


def gather_feat(feat, ind):
    B, C = feat.shape[:2]
    return feat.view(B, C, -1).gather(2, ind[:, None].expand(-1, C, -1)).permute(0, 2, 1)


class ModelWithLoss(nn.Module):
    """Network, id classifier and the learned task-uncertainty weights live in one module, so DDP syncs all of them."""

    def __init__(self, net, num_ids, reid_dim):
        super().__init__()
        self.net = net
        self.classifier = nn.Linear(reid_dim, num_ids)
        self.emb_scale = math.sqrt(2) * math.log(num_ids - 1)
        self.s_det = nn.Parameter(torch.tensor(-1.85))
        self.s_id = nn.Parameter(torch.tensor(-1.05))

    def forward(self, x, t):
        out = self.net(x)
        hm = out["hm"].sigmoid().clamp(1e-4, 1 - 1e-4)
        pos = t["hm"].eq(1).float()
        neg_w = torch.pow(1 - t["hm"], 4)
        l_hm = -(torch.log(hm) * (1 - hm) ** 2 * pos + torch.log(1 - hm) * hm ** 2 * neg_w * (1 - pos)).sum() / pos.sum().clamp(min=1)
        m = t["mask"].unsqueeze(2).float()
        l_wh = (F.l1_loss(gather_feat(out["wh"], t["ind"]) * m, t["wh"] * m, reduction="sum") / (m.sum() + 1e-4))
        l_off = (F.l1_loss(gather_feat(out["reg"], t["ind"]) * m, t["reg"] * m, reduction="sum") / (m.sum() + 1e-4))
        emb = gather_feat(out["id"], t["ind"])[t["mask"] > 0]
        id_target = t["ids"][t["mask"] > 0]
        valid = id_target >= 0
        logits = self.classifier(self.emb_scale * F.normalize(emb[valid], dim=1))
        l_id = F.cross_entropy(logits, id_target[valid]) if valid.any() else logits.sum() * 0
        l_det = l_hm + 0.1 * l_wh + l_off
        loss = 0.5 * (torch.exp(-self.s_det) * l_det + torch.exp(-self.s_id) * l_id + self.s_det + self.s_id)
        return loss, torch.stack([l_hm.detach(), l_wh.detach(), l_off.detach(), l_id.detach()])


@torch.no_grad()
def validate(model, val_items, rank, world):
    model.eval()
    shard = Subset(JDEDataset(val_items, train=False), list(range(rank, len(val_items), world)))
    totals = torch.zeros(5, device="cuda")
    for x, t in DataLoader(shard, batch_size=8, num_workers=4):
        x, t = x.cuda(non_blocking=True), {k: v.cuda(non_blocking=True) for k, v in t.items()}
        t["ids"].fill_(-1)  # val identities are not in the training classifier
        _, parts = model.module(x, t)
        totals[:3] += parts[:3] * x.shape[0]
        totals[4] += x.shape[0]
    dist.all_reduce(totals)
    model.train()
    return (totals[:3] / totals[4]).tolist()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 scans all label files on the first run while the others wait in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = os.path.join("exp", args.exp)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, name=args.exp, config=vars(args))

    with open(args.data_cfg) as f:
        list_files = [l.strip() for l in f if l.strip()]
    items, num_ids = cached_index(list_files, args.data_root, os.path.join(out_dir, "index_train.pkl"), rank)
    val_items, _ = cached_index([args.val_list], args.data_root, os.path.join(out_dir, "index_val.pkl"), rank)

    dataset = JDEDataset(items)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    torch.manual_seed(0)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(CenterNetReID(args.reid_dim))
    model = ModelWithLoss(net, num_ids, args.reid_dim).cuda()
    start_epoch = 0
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [20], 0.1, last_epoch=start_epoch - 1)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (x, t) in enumerate(loader):
            x = x.cuda(non_blocking=True)
            t = {k: v.cuda(non_blocking=True) for k, v in t.items()}
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                loss, parts = model(x, t)
                (loss / args.accum).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss, parts = model(x, t)
                    (loss / args.accum).backward()
            if i % 200 == 0:
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/hm": parts[0].item(), "train/wh": parts[1].item(), "train/off": parts[2].item(),
                               "train/id": parts[3].item(), "s_det": model.module.s_det.item(),
                               "s_id": model.module.s_id.item(), "epoch": epoch})
        scheduler.step()

        val = validate(model, val_items, rank, world)
        if rank == 0:
            wandb.log({"val/hm": val[0], "val/wh": val[1], "val/off": val[2], "epoch": epoch})
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, f"model_{epoch}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
