# DGCNN part segmentation on ShapeNetPart (shapenetcore_partanno_segmentation_benchmark_v0_normal)
#
#   torchrun --nproc_per_node=4 train_partseg.py --root data/shapenetcore_partanno_segmentation_benchmark_v0_normal
#
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import wandb

SEG_CLASSES = {"Earphone": [16, 17, 18], "Motorbike": [30, 31, 32, 33, 34, 35], "Rocket": [41, 42, 43],
               "Car": [8, 9, 10, 11], "Laptop": [28, 29], "Cap": [6, 7], "Skateboard": [44, 45, 46],
               "Mug": [36, 37], "Guitar": [19, 20, 21], "Bag": [4, 5], "Lamp": [24, 25, 26, 27],
               "Table": [47, 48, 49], "Airplane": [0, 1, 2, 3], "Pistol": [38, 39, 40],
               "Chair": [12, 13, 14, 15], "Knife": [22, 23]}
CATEGORIES = sorted(SEG_CLASSES.keys())
NUM_PARTS = 50


class ShapeNetPart(Dataset):
    def __init__(self, root, split, npoints=2048):
        cat_file = [l.strip().split() for l in open(os.path.join(root, "synsetoffset2category.txt"))]
        self.cat2id = {name: offset for name, offset in cat_file}
        self.id2cat = {v: k for k, v in self.cat2id.items()}
        with open(os.path.join(root, "train_test_split", f"shuffled_{split}_file_list.json")) as f:
            ids = json.load(f)
        self.items = []
        for s in ids:
            _, synset, token = s.split("/")
            self.items.append((CATEGORIES.index(self.id2cat[synset]), os.path.join(root, synset, token + ".txt")))
        self.npoints, self.train = npoints, split in ("train", "trainval")

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        cls, path = self.items[i]
        data = np.loadtxt(path).astype(np.float32)
        pts, seg = data[:, :3], data[:, -1].astype(np.int64)
        pts = pts - pts.mean(0)
        pts = pts / np.max(np.linalg.norm(pts, axis=1))
        choice = np.random.choice(len(seg), self.npoints, replace=len(seg) < self.npoints)
        pts, seg = pts[choice], seg[choice]
        if self.train:
            pts = pts * np.random.uniform(2 / 3, 3 / 2, 3).astype(np.float32) + \
                np.random.uniform(-0.2, 0.2, 3).astype(np.float32)
        return torch.from_numpy(pts), cls, torch.from_numpy(seg)


def knn_feature(x, k):
    b, c, n = x.shape
    d = -2 * x.transpose(1, 2) @ x + (x ** 2).sum(1, keepdim=True) + (x ** 2).sum(1, keepdim=True).transpose(1, 2)
    idx = d.topk(k, dim=-1, largest=False)[1] + torch.arange(b, device=x.device).view(-1, 1, 1) * n
    xt = x.transpose(1, 2).reshape(b * n, c)
    nb = xt[idx.reshape(-1)].view(b, n, k, c)
    center = x.transpose(1, 2).unsqueeze(2).expand(-1, -1, k, -1)
    return torch.cat([nb - center, center], 3).permute(0, 3, 1, 2)


class DGCNNPartSeg(nn.Module):
    def __init__(self, k=40, emb=1024, num_parts=NUM_PARTS, num_cats=16):
        super().__init__()
        self.k = k

        def c2(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 1, bias=False), nn.BatchNorm2d(o), nn.LeakyReLU(0.2))

        def c1(i, o):
            return nn.Sequential(nn.Conv1d(i, o, 1, bias=False), nn.BatchNorm1d(o), nn.LeakyReLU(0.2))

        self.ec1 = nn.Sequential(c2(6, 64), c2(64, 64))
        self.ec2 = nn.Sequential(c2(128, 64), c2(64, 64))
        self.ec3 = c2(128, 64)
        self.glob = c1(192, emb)
        self.cat_embed = c1(num_cats, 64)
        self.seg = nn.Sequential(c1(emb + 64 + 192, 256), nn.Dropout(0.5), c1(256, 256), nn.Dropout(0.5),
                                 c1(256, 128), nn.Conv1d(128, num_parts, 1))
        self.num_cats = num_cats

    def forward(self, x, cat):
        n = x.shape[2]
        x1 = self.ec1(knn_feature(x, self.k)).max(-1)[0]
        x2 = self.ec2(knn_feature(x1, self.k)).max(-1)[0]
        x3 = self.ec3(knn_feature(x2, self.k)).max(-1)[0]
        local = torch.cat([x1, x2, x3], 1)
        g = self.glob(local).max(-1, keepdim=True)[0]
        c = self.cat_embed(F.one_hot(cat, self.num_cats).float().unsqueeze(-1))
        g = torch.cat([g, c], 1).expand(-1, -1, n)
        return self.seg(torch.cat([g, local], 1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    shape_ious = {c: [] for c in CATEGORIES}
    correct, seen = 0, 0
    for pts, cat, seg in loader:
        pts, cat, seg = pts.to(device), cat.to(device), seg.to(device)
        logits = model(pts.transpose(1, 2), cat)
        for b in range(pts.shape[0]):
            name = CATEGORIES[cat[b].item()]
            parts = SEG_CLASSES[name]
            # restrict the prediction to the parts of the known category
            pred = logits[b, parts].argmax(0) + parts[0]
            correct += (pred == seg[b]).sum().item()
            seen += seg[b].numel()
            ious = []
            for p in parts:
                inter = ((pred == p) & (seg[b] == p)).sum().item()
                union = ((pred == p) | (seg[b] == p)).sum().item()
                ious.append(1.0 if union == 0 else inter / union)
            shape_ious[name].append(float(np.mean(ious)))
    all_ious = [v for c in CATEGORIES for v in shape_ious[c]]
    instance_miou = float(np.mean(all_ious))
    class_miou = float(np.mean([np.mean(shape_ious[c]) for c in CATEGORIES if shape_ious[c]]))
    return correct / seen, instance_miou, class_miou


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/shapenetcore_partanno_segmentation_benchmark_v0_normal")
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--k", type=int, default=40)
    ap.add_argument("--ckpt_dir", default="ckpt/dgcnn_partseg")
    ap.add_argument("--wandb_project", default="partseg")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), name=f"dgcnn_k{args.k}_{world}gpu")

    train_set = ShapeNetPart(args.root, "trainval")
    test_set = ShapeNetPart(args.root, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=16, sampler=test_sampler, num_workers=8)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DGCNNPartSeg(k=args.k)).to(device)
    model = DDP(model, device_ids=[local_rank])
    # recipe tuned for 32 shapes per step
    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-5)

    best_ins_miou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for pts, cat, seg in train_loader:
            pts, cat, seg = pts.to(device, non_blocking=True), cat.to(device), seg.to(device, non_blocking=True)
            logits = model(pts.transpose(1, 2), cat)
            loss = F.cross_entropy(logits, seg, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        scheduler.step()
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        acc, ins_miou, cls_miou = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] loss {train_loss:.4f} acc {acc:.4f} ins mIoU {ins_miou:.4f} "
                  f"cls mIoU {cls_miou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            wandb.log({"train/loss": train_loss, "test/acc": acc, "test/ins_miou": ins_miou,
                       "test/cls_miou": cls_miou, "lr": scheduler.get_last_lr()[0]}, step=epoch)
            if ins_miou > best_ins_miou:
                best_ins_miou = ins_miou
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "ins_miou": ins_miou},
                           os.path.join(args.ckpt_dir, "best.pth"))
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.ckpt_dir, "last.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best instance mIoU {best_ins_miou:.4f}")
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
