"""TSM-R50 (16 segments) on Mini-Kinetics-200: training + 2x3 multi-view test with
top-1 / top-5 / mean class accuracy and a dump of the video-level scores.

    torchrun --nproc_per_node=8 12_tsm_mv_test_gather.py --root /data/mini_kinetics --out exp/tsm16_mk200
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

IMNET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMNET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-classes", type=int, default=200)
    p.add_argument("--segments", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.02, help="for 128 clips")
    p.add_argument("--clips", type=int, default=2)
    p.add_argument("--crops", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ShiftBlockWrapper(nn.Module):
    def __init__(self, conv, segments, div=8):
        super().__init__()
        self.conv, self.segments, self.div = conv, segments, div

    def forward(self, x):
        nt, c, h, w = x.shape
        v = x.view(-1, self.segments, c, h, w)
        f = c // self.div
        out = torch.zeros_like(v)
        out[:, :-1, :f] = v[:, 1:, :f]
        out[:, 1:, f:2 * f] = v[:, :-1, f:2 * f]
        out[:, :, 2 * f:] = v[:, :, 2 * f:]
        return self.conv(out.view(nt, c, h, w))


class TSM(nn.Module):
    def __init__(self, num_classes, segments):
        super().__init__()
        self.segments = segments
        net = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
            for blk in layer:
                blk.conv1 = ShiftBlockWrapper(blk.conv1, segments)
        net.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, num_classes))
        self.net = net

    def forward(self, x):  # x: B, T, 3, H, W
        b = x.shape[0]
        return self.net(x.flatten(0, 1)).view(b, self.segments, -1).mean(1)


class MiniKinetics(Dataset):
    def __init__(self, root, split, segments, train, clips=1, crops=1):
        self.root, self.segments, self.train, self.clips, self.crops = root, segments, train, clips, crops
        with open(os.path.join(root, f"{split}_list.txt")) as f:
            self.items = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def _sample(self, n, clip):
        seg = n / self.segments
        if self.train:
            off = np.random.rand(self.segments) * seg
        else:
            off = np.full(self.segments, seg * (clip + 0.5) / self.clips)
        return np.minimum((np.arange(self.segments) * seg + off).astype(int), n - 1)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, "videos", path), ctx=cpu(0), num_threads=1)
        n = len(vr)
        if self.train:
            x = torch.from_numpy(vr.get_batch(self._sample(n, 0)).asnumpy()).permute(0, 3, 1, 2).float() / 255
            x = F.interpolate(x, scale_factor=256 / min(x.shape[-2:]), mode="bilinear", align_corners=False)
            h, w = x.shape[-2:]
            t, l = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
            x = x[..., t:t + 224, l:l + 224]
            if np.random.rand() < 0.5:
                x = x.flip(-1)
            return (x - IMNET_MEAN) / IMNET_STD, label
        out = []
        for c in range(self.clips):
            x = torch.from_numpy(vr.get_batch(self._sample(n, c)).asnumpy()).permute(0, 3, 1, 2).float() / 255
            x = F.interpolate(x, scale_factor=224 / min(x.shape[-2:]), mode="bilinear", align_corners=False)
            h, w = x.shape[-2:]
            for k in range(self.crops):
                if w >= h:
                    l = (w - 224) * k // max(self.crops - 1, 1)
                    out.append(x[..., :224, l:l + 224])
                else:
                    t = (h - 224) * k // max(self.crops - 1, 1)
                    out.append(x[..., t:t + 224, :224])
        return (torch.stack(out) - IMNET_MEAN) / IMNET_STD, label


@torch.no_grad()
def multi_view_scores(model, loader, device):
    model.eval()
    scores, labels = [], []
    for views, y in loader:
        b, v = views.shape[:2]
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(views.to(device, non_blocking=True).flatten(0, 1))
        scores.append(out.float().softmax(-1).view(b, v, -1).mean(1))
        labels.append(y.to(device))
    return torch.cat(scores), torch.cat(labels)


def gather_all(scores, labels):
    world = dist.get_world_size()
    all_scores = [torch.zeros_like(scores) for _ in range(world)]
    all_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_labels, labels)
    return torch.cat(all_scores), torch.cat(all_labels)


def report(scores, labels, num_classes):
    top5 = scores.topk(5, 1).indices
    top1_acc = (top5[:, 0] == labels).float().mean().item() * 100
    top5_acc = (top5 == labels[:, None]).any(1).float().mean().item() * 100
    per_class = []
    for c in range(num_classes):
        m = labels == c
        if m.any():
            per_class.append((top5[m, 0] == c).float().mean().item())
    return top1_acc, top5_acc, 100 * float(np.mean(per_class))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = TSM(args.num_classes, args.segments)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = MiniKinetics(args.root, "train", args.segments, True)
    test_set = MiniKinetics(args.root, "val", args.segments, False, args.clips, args.crops)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, list(range(rank, len(test_set), world))), batch_size=1,
                             num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            scaler.step(optimizer)
            scaler.update()
            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
        scheduler.step()
        dist.all_reduce(loss_meter)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.5f} time {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, "latest.pth"))

    scores, labels = multi_view_scores(model.module, test_loader, device)
    scores, labels = gather_all(scores, labels)
    if rank == 0:
        top1, top5, mca = report(scores, labels, args.num_classes)
        print(f"{args.clips}x{args.crops} views: top1 {top1:.2f} top5 {top5:.2f} mean class acc {mca:.2f}")
        np.save(os.path.join(args.out, "val_scores.npy"), scores.cpu().numpy())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
