"""DRAEM on VisA (1cls split), distributed data parallel.

--batch-size is the global batch of the original recipe (8); it is divided over the GPUs so
that the optimisation matches the single-GPU paper setting.

    torchrun --nproc_per_node=4 18_draem_visa.py --visa-root /data/VisA_20220922 --object pcb3 \
        --anomaly-source /data/dtd/images --batch-size 8
"""
import argparse
import glob
import os
import random

import cv2
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from perlin_numpy import generate_perlin_noise_2d
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def read_split(visa_root, obj, split):
    df = pd.read_csv(os.path.join(visa_root, "split_csv", "1cls.csv"))
    df = df[(df["object"] == obj) & (df["split"] == split)].reset_index(drop=True)
    return [(os.path.join(visa_root, r.image), r.label,
             None if pd.isna(r.mask) else os.path.join(visa_root, r.mask)) for r in df.itertuples()]


def load_rgb(path, size):
    return cv2.resize(cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB), (size, size)).astype(np.float32) / 255.0


class VisATrain(Dataset):
    def __init__(self, items, anomaly_source, size=256):
        self.items = [it for it in items if it[1] == "normal"]
        self.sources = sorted(glob.glob(os.path.join(anomaly_source, "*", "*.jpg")))
        self.size = size

    def __len__(self):
        return len(self.items)

    def synth(self, img):
        if random.random() < 0.5:
            return img, np.zeros((self.size, self.size, 1), np.float32), 0.0
        src = load_rgb(random.choice(self.sources), self.size)
        sx, sy = 2 ** random.randint(0, 5), 2 ** random.randint(0, 5)
        noise = generate_perlin_noise_2d((self.size, self.size), (sx, sy))
        noise = cv2.warpAffine(noise, cv2.getRotationMatrix2D((self.size / 2, self.size / 2),
                                                              random.uniform(-90, 90), 1.0), (self.size, self.size))
        mask = (noise > 0.5).astype(np.float32)[..., None]
        beta = random.uniform(0, 0.8)
        aug = img * (1 - mask) + (1 - beta) * src * mask + beta * img * mask
        return aug.astype(np.float32), mask, float(mask.any())

    def __getitem__(self, i):
        img = load_rgb(self.items[i][0], self.size)
        aug, mask, has = self.synth(img)
        chw = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return chw(img), chw(aug), chw(mask), has


class VisATest(Dataset):
    def __init__(self, items, size=256):
        self.items, self.size = items, size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label, mask_path = self.items[i]
        img = torch.from_numpy(load_rgb(path, self.size).transpose(2, 0, 1).copy())
        if mask_path is None:
            mask = torch.zeros(1, self.size, self.size)
        else:
            m = cv2.resize(cv2.imread(mask_path, cv2.IMREAD_GRAYSCALE), (self.size, self.size),
                           interpolation=cv2.INTER_NEAREST)
            mask = torch.from_numpy((m > 0).astype(np.float32))[None]
        return img, mask, int(label == "anomaly")


def cbr(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class EncDec(nn.Module):
    def __init__(self, cin, cout, base, skips):
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8, base * 8]
        self.enc = nn.ModuleList()
        prev = cin
        for c in ch:
            self.enc.append(nn.Sequential(cbr(prev, c), cbr(c, c)))
            prev = c
        self.dec = nn.ModuleList()
        for i in range(len(ch) - 1, 0, -1):
            self.dec.append(nn.ModuleDict({
                "up": nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), cbr(ch[i], ch[i - 1])),
                "conv": nn.Sequential(cbr(ch[i - 1] * (2 if skips else 1), ch[i - 1]), cbr(ch[i - 1], ch[i - 1])),
            }))
        self.out = nn.Conv2d(ch[0], cout, 3, padding=1)
        self.skips = skips

    def forward(self, x):
        feats = []
        for i, blk in enumerate(self.enc):
            x = blk(x if i == 0 else F.max_pool2d(x, 2))
            feats.append(x)
        for j, d in enumerate(self.dec):
            x = d["up"](x)
            if self.skips:
                x = torch.cat([x, feats[-2 - j]], 1)
            x = d["conv"](x)
        return self.out(x)


class DRAEM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rec = EncDec(3, 3, 128, skips=False)
        self.seg = EncDec(6, 2, 64, skips=True)

    def forward(self, x):
        rec = self.rec(x)
        return rec, self.seg(torch.cat([rec, x], 1))


def ssim_loss(a, b, win=11):
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    pad = win // 2
    mu_a, mu_b = F.avg_pool2d(a, win, 1, pad), F.avg_pool2d(b, win, 1, pad)
    s_a = F.avg_pool2d(a * a, win, 1, pad) - mu_a ** 2
    s_b = F.avg_pool2d(b * b, win, 1, pad) - mu_b ** 2
    s_ab = F.avg_pool2d(a * b, win, 1, pad) - mu_a * mu_b
    ssim = ((2 * mu_a * mu_b + c1) * (2 * s_ab + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (s_a + s_b + c2))
    return 1 - ssim.mean()


def focal(logits, target, gamma=2, alpha=0.25):
    p = torch.softmax(logits, 1)[:, 1:]
    ce = F.cross_entropy(logits, target.squeeze(1).long(), reduction="none").unsqueeze(1)
    pt = torch.where(target > 0.5, p, 1 - p)
    w = torch.where(target > 0.5, alpha, 1 - alpha)
    return (w * (1 - pt) ** gamma * ce).mean()


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    ys, si, ms, sp = [], [], [], []
    for x, m, y in loader:
        _, seg = model(x.to(device))
        p = torch.softmax(seg, 1)[:, 1:]
        si.append(F.avg_pool2d(p, 21, 1, 10).amax(dim=(1, 2, 3)).cpu())
        ys.append(y)
        sp.append(p[:, :, ::2, ::2].flatten().cpu())
        ms.append(m[:, :, ::2, ::2].flatten())
    model.train()
    ys, si = torch.cat(ys).numpy(), torch.cat(si).numpy()
    ms, sp = torch.cat(ms).numpy().astype(np.uint8), torch.cat(sp).numpy()
    return {"image_auroc": roc_auc_score(ys, si), "pixel_auroc": roc_auc_score(ms, sp),
            "pixel_ap": average_precision_score(ms, sp)}


def seed_numpy(worker_id):
    # perlin_numpy draws from the global numpy RNG, which forked workers would otherwise share
    np.random.seed(torch.initial_seed() % 2 ** 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--visa-root", default="/data/VisA_20220922")
    ap.add_argument("--object", default="pcb3")
    ap.add_argument("--anomaly-source", default="/data/dtd/images")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch size")
    ap.add_argument("--epochs", type=int, default=700)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--log-dir", default="logs/draem_visa")
    ap.add_argument("--ckpt-dir", default="checkpoints/draem_visa")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)

    train_ds = VisATrain(read_split(args.visa_root, args.object, "train"), args.anomaly_source)
    test_ds = VisATest(read_split(args.visa_root, args.object, "test"))
    per_gpu_bs = max(1, args.batch_size // world)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, worker_init_fn=seed_numpy)
    test_loader = DataLoader(test_ds, batch_size=16, num_workers=8)

    model = DRAEM().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([{"params": model.module.rec.parameters(), "lr": args.lr},
                                  {"params": model.module.seg.parameters(), "lr": args.lr}])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(args.epochs * 0.8), int(args.epochs * 0.9)], 0.2)

    writer = SummaryWriter(os.path.join(args.log_dir, args.object)) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for img, aug, mask, _ in loader:
            img, aug, mask = img.to(device), aug.to(device), mask.to(device)
            rec, seg = model(aug)
            l2 = F.mse_loss(rec, img)
            ls = ssim_loss(rec, img)
            lf = focal(seg, mask)
            loss = l2 + ls + lf
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalars("loss", {"l2": l2.item(), "ssim": ls.item(), "focal": lf.item()}, step)
        scheduler.step()

        if rank == 0 and ((epoch + 1) % 50 == 0 or epoch + 1 == args.epochs):
            metrics = test(model.module, test_loader, device)
            for k, v in metrics.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            print(f"[{args.object}] epoch {epoch + 1} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, f"draem_{args.object}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
