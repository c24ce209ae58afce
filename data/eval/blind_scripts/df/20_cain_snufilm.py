"""CAIN (channel attention is all you need) trained on Vimeo-90K triplets and evaluated on the four SNU-FILM
difficulty splits after every epoch.

    torchrun --nproc_per_node=4 20_cain_snufilm.py --vimeo /data/vimeo_triplet --snufilm /data/SNU-FILM
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pytorch_msssim import ssim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SPLITS = ("easy", "medium", "hard", "extreme")
log = logging.getLogger("cain")


def to_tensor(path):
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255.0


class VimeoTrain(Dataset):
    def __init__(self, root, crop=256):
        with open(os.path.join(root, "tri_trainlist.txt")) as f:
            self.dirs = [os.path.join(root, "sequences", l.strip()) for l in f if l.strip()]
        self.crop = crop

    def __len__(self):
        return len(self.dirs)

    def __getitem__(self, i):
        x = torch.stack([to_tensor(os.path.join(self.dirs[i], f"im{k}.png")) for k in (1, 2, 3)])
        h, w = x.shape[-2:]
        t, l = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        x = x[..., t:t + self.crop, l:l + self.crop]
        if random.random() < 0.5:
            x = x.flip(-1)
        if random.random() < 0.5:
            x = x.flip(-2)
        if random.random() < 0.5:
            x = x.flip(0)
        return x


class SNUFILM(Dataset):
    """test-<split>.txt lists 'frame0 frame1 frame2' paths relative to the SNU-FILM root."""

    def __init__(self, root, split):
        with open(os.path.join(root, f"test-{split}.txt")) as f:
            self.triplets = [l.split() for l in f if l.strip()]
        self.root = root

    def __len__(self):
        return len(self.triplets)

    def __getitem__(self, i):
        paths = [os.path.join(self.root, p.replace("data/SNU-FILM/", "")) for p in self.triplets[i]]
        return torch.stack([to_tensor(p) for p in paths])


class CALayer(nn.Module):
    def __init__(self, c, r=16):
        super().__init__()
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // r, 1), nn.ReLU(True),
                                  nn.Conv2d(c // r, c, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.body(x)


class RCAB(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.LeakyReLU(0.2, True), nn.Conv2d(c, c, 3, 1, 1), CALayer(c))

    def forward(self, x):
        return x + self.body(x)


class ResGroup(nn.Module):
    def __init__(self, c, n):
        super().__init__()
        self.body = nn.Sequential(*[RCAB(c) for _ in range(n)], nn.Conv2d(c, c, 3, 1, 1))

    def forward(self, x):
        return x + self.body(x)


class CAIN(nn.Module):
    def __init__(self, depth=3, groups=5, blocks=12):
        super().__init__()
        self.depth = depth
        c = 3 * 4 ** depth
        self.head = nn.Conv2d(2 * c, c, 3, 1, 1)
        self.body = nn.Sequential(*[ResGroup(c, blocks) for _ in range(groups)])
        self.tail = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x0, x1):
        m0, m1 = x0.mean((2, 3), keepdim=True), x1.mean((2, 3), keepdim=True)
        f0 = F.pixel_unshuffle(x0 - m0, 2 ** self.depth)
        f1 = F.pixel_unshuffle(x1 - m1, 2 ** self.depth)
        y = self.tail(self.body(self.head(torch.cat([f0, f1], 1))))
        return F.pixel_shuffle(y, 2 ** self.depth) + (m0 + m1) / 2


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    psnrs, ssims = [], []
    for x in loader:
        x = x.to(device)
        i0, gt, i1 = x[:, 0], x[:, 1], x[:, 2]
        h, w = i0.shape[-2:]
        ph, pw = (-h) % 32, (-w) % 32
        pred = net(F.pad(i0, (0, pw, 0, ph), mode="reflect"), F.pad(i1, (0, pw, 0, ph), mode="reflect"))
        pred = pred[..., :h, :w].clamp(0, 1)
        pred = torch.round(pred * 255) / 255
        mse = (pred - gt).pow(2).mean((1, 2, 3))
        psnrs.extend((-10 * torch.log10(mse)).tolist())
        ssims.extend(ssim(pred, gt, data_range=1.0, size_average=False).tolist())
    net.train()
    return float(np.mean(psnrs)), float(np.mean(ssims))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vimeo", required=True)
    ap.add_argument("--snufilm", required=True)
    ap.add_argument("--out", default="runs/cain")
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=200)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    random.seed(rank)

    net = CAIN().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)

    train_set = VimeoTrain(args.vimeo)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    test_loaders = {}
    for split in SPLITS:
        ds = SNUFILM(args.snufilm, split)
        test_loaders[split] = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, shuffle=False), num_workers=2)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x in loader:
            x = x.to(device, non_blocking=True)
            pred = model(x[:, 0], x[:, 2])
            loss = (pred - x[:, 1]).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/l1", loss.item(), step)

        results = {s: evaluate(net, dl, device) for s, dl in test_loaders.items()}
        mean_psnr = float(np.mean([r[0] for r in results.values()]))
        sched.step(mean_psnr)
        if rank == 0:
            for s, (p, q) in results.items():
                writer.add_scalar(f"snufilm_{s}/psnr", p, epoch)
                writer.add_scalar(f"snufilm_{s}/ssim", q, epoch)
            log.info("epoch %d  " + "  ".join(f"{s}: {p:.2f}/{q:.4f}" for s, (p, q) in results.items()), epoch)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "results": results}
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "last.pth"))
            if mean_psnr > best:
                best = mean_psnr
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
