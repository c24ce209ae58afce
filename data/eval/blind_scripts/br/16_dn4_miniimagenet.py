"""DN4: Revisiting Local Descriptor based Image-to-Class Measure for Few-shot Learning.

Multi-GPU episodic training on mini-ImageNet.

    torchrun --nproc_per_node=4 16_dn4_miniimagenet.py --dataset_dir /data/miniImageNet --shot_num 1
"""
import argparse
import os
import os.path as osp
import random
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
import torchvision.transforms as transforms

parser = argparse.ArgumentParser()
parser.add_argument("--dataset_dir", default="/data/miniImageNet")
parser.add_argument("--outf", default="./results/DN4")
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--episode_train_num", type=int, default=10000, help="per GPU per epoch")
parser.add_argument("--episode_val_num", type=int, default=1000)
parser.add_argument("--way_num", type=int, default=5)
parser.add_argument("--shot_num", type=int, default=1)
parser.add_argument("--query_num", type=int, default=15)
parser.add_argument("--neighbor_k", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.005)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--print_freq", type=int, default=500)
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--seed", type=int, default=42)


class ImageList(Dataset):
    def __init__(self, root, split, transform):
        rows = [l.strip().split(",") for l in open(osp.join(root, f"{split}.csv")).readlines()[1:]]
        wnids = sorted({r[1] for r in rows})
        self.items = [(osp.join(root, "images", r[0]), wnids.index(r[1])) for r in rows]
        self.labels = np.array([y for _, y in self.items])
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), y


class EpisodeSampler:
    def __init__(self, labels, episodes, way, shot, query, seed):
        self.pool = {c: list(np.flatnonzero(labels == c)) for c in np.unique(labels)}
        self.episodes, self.way, self.shot, self.query = episodes, way, shot, query
        self.rng = random.Random(seed)

    def __len__(self):
        return self.episodes

    def __iter__(self):
        for _ in range(self.episodes):
            classes = self.rng.sample(sorted(self.pool), self.way)
            support, query = [], []
            for c in classes:
                picked = self.rng.sample(self.pool[c], self.shot + self.query)
                support += picked[:self.shot]
                query += picked[self.shot:]
            yield support + query  # class-major support, then class-major query


class Conv64F(nn.Module):
    def __init__(self):
        super().__init__()

        def layer(i, o, pool):
            mods = [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.LeakyReLU(0.2, True)]
            return mods + ([nn.MaxPool2d(2)] if pool else [])

        self.features = nn.Sequential(*layer(3, 64, True), *layer(64, 64, True),
                                      *layer(64, 64, False), *layer(64, 64, False))

    def forward(self, x):
        return self.features(x)  # 64 x 21 x 21 local descriptors


class DN4(nn.Module):
    def __init__(self, neighbor_k=3):
        super().__init__()
        self.encoder = Conv64F()
        self.neighbor_k = neighbor_k

    def forward(self, images, way, shot):
        feats = self.encoder(images)
        b, c = feats.shape[:2]
        desc = F.normalize(feats.view(b, c, -1), dim=1)          # [B, C, HW]
        support = desc[:way * shot].view(way, shot, c, -1)
        support = support.permute(0, 2, 1, 3).reshape(way, c, -1)  # [way, C, shot*HW]
        query = desc[way * shot:].transpose(1, 2)                   # [Q, HW, C]
        sim = torch.einsum("qhc,wcs->qwhs", query, support)         # [Q, way, HW, shot*HW]
        return sim.topk(self.neighbor_k, dim=-1).values.sum(dim=(-1, -2))


@torch.no_grad()
def validate(model, loader, args, device):
    model.eval()
    y = torch.arange(args.way_num, device=device).repeat_interleave(args.query_num)
    accs = []
    for x, _ in loader:
        pred = model(x.to(device, non_blocking=True), args.way_num, args.shot_num).argmax(1)
        accs.append((pred == y).float().mean())
    model.train()
    accs = torch.stack(accs)
    tot = torch.stack([accs.sum(), accs.pow(2).sum(), torch.full((), float(len(accs)), device=device)])
    dist.all_reduce(tot)
    m = tot[0] / tot[2]
    return m.item(), (1.96 * (tot[1] / tot[2] - m * m).clamp_min(0).sqrt() / tot[2].sqrt()).item()


def main():
    args = parser.parse_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    cudnn.benchmark = True
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    tf_train = transforms.Compose([transforms.Resize((84, 84)), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    tf_test = transforms.Compose([transforms.Resize((84, 84)), transforms.ToTensor(), normalize])
    train_set = ImageList(args.dataset_dir, "train", tf_train)
    val_set = ImageList(args.dataset_dir, "val", tf_test)
    val_loader = DataLoader(val_set, num_workers=args.workers, pin_memory=True,
                            batch_sampler=EpisodeSampler(val_set.labels, args.episode_val_num // world_size,
                                                         args.way_num, args.shot_num, args.query_num,
                                                         seed=1 + rank))

    model = DN4(args.neighbor_k).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(args.beta1, 0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    criterion = nn.CrossEntropyLoss().to(device)
    if rank == 0:
        os.makedirs(args.outf, exist_ok=True)

    y_train = torch.arange(args.way_num, device=device).repeat_interleave(args.query_num)
    best_prec1 = 0.0
    for epoch in range(args.epochs):
        # new episodes every epoch, different on every GPU
        train_loader = DataLoader(
            train_set, num_workers=args.workers, pin_memory=True,
            batch_sampler=EpisodeSampler(train_set.labels, args.episode_train_num, args.way_num,
                                         args.shot_num, args.query_num,
                                         seed=args.seed + 1000 * epoch + rank))
        end = time.time()
        for i, (x, _) in enumerate(train_loader):
            logits = model(x.to(device, non_blocking=True), args.way_num, args.shot_num)
            loss = criterion(logits, y_train)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % args.print_freq == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"time {(time.time() - end) / (i + 1):.3f}s/ep", flush=True)
        scheduler.step()

        prec1, ci = validate(model, val_loader, args, device)
        if rank == 0:
            print(f" * Epoch {epoch} val Prec@1 {100 * prec1:.2f} +- {100 * ci:.2f}", flush=True)
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            state = {"epoch_index": epoch, "arch": "Conv64F", "best_prec1": best_prec1,
                     "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, osp.join(args.outf, "epoch_last.pth.tar"))
            if is_best:
                torch.save(state, osp.join(args.outf, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
