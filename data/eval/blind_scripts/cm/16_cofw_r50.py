"""
COFW-29 facial landmarks: ResNet-50 + deconv head, Gaussian heatmaps with
soft-argmax decoding, tracked in Weights & Biases.

    torchrun --nproc_per_node=4 16_cofw_r50.py --train data/cofw/train.json --test data/cofw/test.json
"""
import argparse
import json
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_PTS = 29
COFW_FLIP = [1, 0, 3, 2, 6, 7, 4, 5, 9, 8, 11, 10, 14, 15, 12, 13, 17, 16, 19, 18, 20, 21, 23, 22, 24, 25, 26, 27, 28]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", default="ckpt/cofw_r50")
    p.add_argument("--project", default="face-landmarks")
    p.add_argument("--input", type=int, default=256)
    p.add_argument("--hm", type=int, default=64)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class COFW(Dataset):
    def __init__(self, json_path, inp, hm, sigma, train):
        with open(json_path) as f:
            self.items = json.load(f)  # [{"image": ..., "bbox": [x1,y1,x2,y2], "points": [[x,y]*29]}, ...]
        self.inp, self.hm, self.sigma, self.train = inp, hm, sigma, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        it = self.items[idx]
        img = cv2.cvtColor(cv2.imread(it["image"]), cv2.COLOR_BGR2RGB)
        pts = np.array(it["points"], np.float32)
        x1, y1, x2, y2 = it["bbox"]
        c = np.array([(x1 + x2) / 2, (y1 + y2) / 2], np.float32)
        side = max(x2 - x1, y2 - y1) * 1.3
        rot = 0.0
        if self.train:
            rot = random.uniform(-25, 25)
            side *= random.uniform(0.9, 1.15)
            if random.random() < 0.5:
                img = np.ascontiguousarray(img[:, ::-1])
                pts[:, 0] = img.shape[1] - 1 - pts[:, 0]
                pts = pts[COFW_FLIP]
                c[0] = img.shape[1] - 1 - c[0]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, self.inp / side)
        M[:, 2] += self.inp / 2 - c
        crop = cv2.warpAffine(img, M, (self.inp, self.inp), borderMode=cv2.BORDER_REPLICATE)
        pts = np.c_[pts, np.ones(N_PTS)] @ M.T
        g = np.arange(self.hm, dtype=np.float32)
        pts_hm = pts * self.hm / self.inp
        target = np.exp(-((g[None, None, :] - pts_hm[:, 0, None, None]) ** 2 +
                          (g[None, :, None] - pts_hm[:, 1, None, None]) ** 2) / (2 * self.sigma ** 2))
        x = torch.from_numpy(crop).permute(2, 0, 1).float() / 255.0
        x = torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, torch.from_numpy(target.astype(np.float32)), torch.from_numpy(pts.astype(np.float32))


class LandmarkNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.encoder = nn.Sequential(*list(r.children())[:-2])
        ups, ch = [], 2048
        for _ in range(3):
            ups += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            ch = 256
        self.decoder = nn.Sequential(*ups)
        self.head = nn.Conv2d(256, N_PTS, 1)

    def forward(self, x):
        return self.head(self.decoder(self.encoder(x)))


def soft_argmax(hm, beta=50.0):
    b, k, h, w = hm.shape
    p = F.softmax(hm.flatten(2) * beta, -1).view(b, k, h, w)
    xs = torch.arange(w, device=hm.device, dtype=hm.dtype)
    ys = torch.arange(h, device=hm.device, dtype=hm.dtype)
    return torch.stack([(p.sum(2) * xs).sum(-1), (p.sum(3) * ys).sum(-1)], -1)


@torch.no_grad()
def evaluate(model, loader, scale):
    model.eval()
    acc = torch.zeros(3, device="cuda", dtype=torch.float64)   # sum NME, failures, count
    for x, _, pts in loader:
        pred = soft_argmax(model(x.cuda(non_blocking=True)).float()) * scale
        pts = pts.cuda()
        iod = torch.linalg.norm(pts[:, 8] - pts[:, 9], dim=-1)
        nme = torch.linalg.norm(pred - pts, dim=-1).mean(-1) / iod
        acc += torch.stack([nme.sum().double(), (nme > 0.1).sum().double(),
                            torch.tensor(float(len(nme)), device="cuda", dtype=torch.float64)])
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


class EvalSampler(torch.utils.data.Sampler):
    def __init__(self, n, rank, world):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    run = wandb.init(project=args.project, name=f"cofw-r50-{args.input}", config=vars(args))

    train_set = COFW(args.train, args.input, args.hm, args.sigma, train=True)
    test_set = COFW(args.test, args.input, args.hm, args.sigma, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 32, sampler=EvalSampler(len(test_set), rank, world), num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(LandmarkNet()).cuda()
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, [50, 70], 0.1)
    scale = args.input / args.hm

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_nme = 1.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, target, pts in train_loader:
            x, target, pts = x.cuda(non_blocking=True), target.cuda(non_blocking=True), pts.cuda(non_blocking=True)
            hm = model(x)
            hm_loss = F.mse_loss(hm, target) * 1000
            coord_loss = F.l1_loss(soft_argmax(hm) * scale, pts) / args.input
            loss = hm_loss + coord_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/hm_loss": hm_loss.item(),
                           "train/coord_loss": coord_loss.item(), "lr": optimizer.param_groups[0]["lr"]}, step=step)
        sched.step()

        nme, fr = evaluate(net, test_loader, scale)
        wandb.log({"test/nme": nme, "test/fr@0.1": fr, "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: NME {100 * nme:.2f}% FR {100 * fr:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            if nme < best_nme:
                best_nme = nme
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
                run.summary["best_nme"] = best_nme
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
