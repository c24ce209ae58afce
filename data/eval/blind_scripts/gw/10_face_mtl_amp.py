"""Multi-task face analysis: 98-point landmarks (WFLW), 40 binary attributes
(CelebA) and age regression (UTKFace), each from its own dataset, one shared
ResNet-50 trunk and three heads. Mixed precision training.

    torchrun --nproc_per_node=8 face_mtl.py --wflw /data/WFLW --celeba /data/celeba --utk /data/UTKFace
"""
import argparse
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision.transforms import functional as TF

logger = logging.getLogger("face_mtl")
SIZE = 256


def load_rgb(path):
    return Image.open(path).convert("RGB")


def norm(img):
    return TF.normalize(TF.to_tensor(img), [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])


class WFLW(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"list_98pt_{split}.txt")) as f:
            rows = [l.split() for l in f if l.strip()]
        self.items = [(os.path.join(root, "crops", r[-1]), np.array(r[:196], dtype=np.float32).reshape(98, 2))
                      for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pts = self.items[i]
        img = load_rgb(p)
        w, h = img.size
        img = img.resize((SIZE, SIZE))
        pts = pts / np.array([w, h], dtype=np.float32)  # normalised to [0, 1]
        return norm(img), torch.from_numpy(pts)


class CelebAAttr(Dataset):
    def __init__(self, root, split):
        ds = torchvision.datasets.CelebA(root, split=split, target_type="attr", download=False)
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, attr = self.ds[i]
        return norm(img.resize((SIZE, SIZE))), attr.float()


class UTKAge(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.files = [l.strip() for l in f if l.strip()]
        self.root = root

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        fn = self.files[i]
        age = float(fn.split("_")[0])
        return norm(load_rgb(os.path.join(self.root, fn)).resize((SIZE, SIZE))), torch.tensor(age / 100.0)


class FaceMTL(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.trunk = nn.Sequential(*list(r.children())[:-1])
        self.lmk = nn.Sequential(nn.Linear(2048, 512), nn.ReLU(inplace=True), nn.Linear(512, 196))
        self.attr = nn.Linear(2048, 40)
        self.age = nn.Sequential(nn.Linear(2048, 256), nn.ReLU(inplace=True), nn.Linear(256, 1))

    def forward(self, x_lmk, x_attr, x_age):
        sizes = [x_lmk.size(0), x_attr.size(0), x_age.size(0)]
        f = self.trunk(torch.cat([x_lmk, x_attr, x_age])).flatten(1)
        f1, f2, f3 = f.split(sizes)
        return self.lmk(f1).view(-1, 98, 2).sigmoid(), self.attr(f2), self.age(f3).squeeze(-1)


def wing_loss(pred, target, w=10.0, eps=2.0):
    d = (pred - target).abs() * SIZE
    c = w - w * math.log(1 + w / eps)
    return torch.where(d < w, w * torch.log1p(d / eps), d - c).mean()


def cycle(loader, sampler):
    e = 0
    while True:
        sampler.set_epoch(e)
        yield from loader
        e += 1


@torch.no_grad()
def evaluate(net, sets, device, rank, world):
    net.eval()
    acc = torch.zeros(6, device=device, dtype=torch.float64)  # nme_sum, n_lmk, attr_correct, attr_n, age_abs, n_age
    for name, ds in sets.items():
        for x, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, num_workers=6):
            x, y = x.to(device), y.to(device)
            f = net.trunk(x).flatten(1)
            if name == "lmk":
                p = net.lmk(f).view(-1, 98, 2).sigmoid()
                iod = (y[:, 60] - y[:, 72]).norm(dim=-1)  # outer eye corners
                acc[0] += ((p - y).norm(dim=-1).mean(-1) / iod).sum()
                acc[1] += len(y)
            elif name == "attr":
                acc[2] += ((net.attr(f) > 0).float() == y).sum()
                acc[3] += y.numel()
            else:
                acc[4] += ((net.age(f).squeeze(-1) - y).abs() * 100).sum()
                acc[5] += len(y)
    dist.all_reduce(acc)
    net.train()
    return {"NME": (acc[0] / acc[1]).item(), "attr_acc": (acc[2] / acc[3]).item(), "age_MAE": (acc[4] / acc[5]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wflw", required=True)
    ap.add_argument("--celeba", required=True)
    ap.add_argument("--utk", required=True)
    ap.add_argument("--bs", type=int, default=32, help="per task per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--iters", type=int, default=120000)
    ap.add_argument("--w_lmk", type=float, default=1.0)
    ap.add_argument("--w_attr", type=float, default=0.5)
    ap.add_argument("--w_age", type=float, default=2.0)
    ap.add_argument("--save", default="checkpoints/face_mtl")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    torch.manual_seed(0)

    train = {"lmk": WFLW(args.wflw, "train"), "attr": CelebAAttr(args.celeba, "train"), "age": UTKAge(args.utk, "train")}
    val = {"lmk": WFLW(args.wflw, "test"), "attr": CelebAAttr(args.celeba, "valid"), "age": UTKAge(args.utk, "test")}
    streams = {}
    for k, ds in train.items():
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        dl = DataLoader(ds, batch_size=args.bs, sampler=s, num_workers=5, pin_memory=True, drop_last=True)
        streams[k] = cycle(dl, s)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(FaceMTL()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.iters, pct_start=0.03)
    scaler = torch.cuda.amp.GradScaler()

    model.train()
    for it in range(1, args.iters + 1):
        xl, yl = next(streams["lmk"])
        xa, ya = next(streams["attr"])
        xg, yg = next(streams["age"])
        xl, yl, xa, ya, xg, yg = (t.to(device, non_blocking=True) for t in (xl, yl, xa, ya, xg, yg))

        with torch.autocast("cuda", dtype=torch.float16):
            p_lmk, p_attr, p_age = model(xl, xa, xg)
        l_lmk = wing_loss(p_lmk.float(), yl)
        l_attr = F.binary_cross_entropy_with_logits(p_attr.float(), ya)
        l_age = F.smooth_l1_loss(p_age.float(), yg, beta=0.05)
        loss = args.w_lmk * l_lmk + args.w_attr * l_attr + args.w_age * l_age

        if not torch.isfinite(loss):
            logger.warning("non-finite loss at iter %d (lmk %.3f attr %.3f age %.3f), skipping batch",
                           it, l_lmk.item(), l_attr.item(), l_age.item())
            opt.zero_grad(set_to_none=True)
            continue

        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        sched.step()

        if it % 100 == 0:
            rep = torch.stack([l_lmk.detach(), l_attr.detach(), l_age.detach()])
            dist.all_reduce(rep, op=dist.ReduceOp.AVG)
            logger.info("it %d lmk %.4f attr %.4f age %.4f lr %.2e scale %.0f", it, *rep.tolist(),
                        sched.get_last_lr()[0], scaler.get_scale())
        if it % 5000 == 0 or it == args.iters:
            res = evaluate(net, val, device, rank, world)
            logger.info("eval it %d %s", it, res)
            if rank == 0:
                os.makedirs(args.save, exist_ok=True)
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "scaler": scaler.state_dict(), "it": it}, os.path.join(args.save, "last.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
