#!/usr/bin/env python3
"""
Memory-network VOS trainer started with torch.multiprocessing.spawn (one process per GPU),
following the layout of the PyTorch ImageNet example so it also runs on several nodes.

single node, all GPUs:
    python train_spawn.py --data /data/DAVIS2017 --yt /data/ytvos18/train --dist-url tcp://127.0.0.1:29517
two nodes (run on each, node-rank 0/1):
    python train_spawn.py ... --nodes 2 --node-rank 0 --dist-url tcp://10.1.0.11:29517
"""
import argparse
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import FrozenBatchNorm2d

parser = argparse.ArgumentParser(description="VOS memory network")
parser.add_argument("--data", required=True, help="DAVIS-2017 root")
parser.add_argument("--yt", required=True, help="YouTube-VOS train root")
parser.add_argument("--out", default="checkpoints/spawn_run")
parser.add_argument("--epochs", default=60, type=int)
parser.add_argument("-b", "--batch-size", default=32, type=int, help="total over all GPUs of all nodes")
parser.add_argument("--lr", default=4e-5, type=float)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("-j", "--workers", default=6, type=int)
parser.add_argument("--size", default=384, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--nodes", default=1, type=int)
parser.add_argument("--node-rank", default=0, type=int)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:29517", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--seed", default=7, type=int)
parser.add_argument("--print-freq", default=50, type=int)


class ClipSet(Dataset):
    def __init__(self, img_root, ann_root, size, n_frames=3, max_skip=15):
        self.img_root, self.ann_root, self.size = img_root, ann_root, size
        self.n_frames, self.max_skip = n_frames, max_skip
        self.videos = sorted(os.listdir(ann_root))
        self.names = {v: sorted(f[:-4] for f in os.listdir(os.path.join(ann_root, v))) for v in self.videos}

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v = self.videos[i]
        names = self.names[v]
        skip = random.randint(1, self.max_skip)
        s = random.randint(0, max(0, len(names) - 1 - skip * (self.n_frames - 1)))
        picks = [names[min(s + k * skip, len(names) - 1)] for k in range(self.n_frames)]
        flip = random.random() < 0.5
        imgs, anns = [], []
        for n in picks:
            im = Image.open(os.path.join(self.img_root, v, n + ".jpg")).convert("RGB").resize((self.size, self.size), Image.BILINEAR)
            an = Image.open(os.path.join(self.ann_root, v, n + ".png")).resize((self.size, self.size), Image.NEAREST)
            if flip:
                im, an = im.transpose(Image.FLIP_LEFT_RIGHT), an.transpose(Image.FLIP_LEFT_RIGHT)
            imgs.append(torchvision.transforms.functional.normalize(torchvision.transforms.functional.to_tensor(im),
                                                                    [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))
            anns.append(np.asarray(an))
        ids = [o for o in np.unique(anns[0]) if o != 0]
        obj = random.choice(ids) if ids else -1
        masks = torch.from_numpy(np.stack([a == obj for a in anns]).astype(np.float32))
        return torch.stack(imgs), masks


class MemNet(nn.Module):
    def __init__(self):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=FrozenBatchNorm2d)
        self.q_enc = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2, r50.layer3)
        r18 = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        w = r18.conv1.weight.detach()
        r18.conv1 = nn.Conv2d(4, 64, 7, 2, 3, bias=False)
        with torch.no_grad():
            r18.conv1.weight.copy_(torch.cat([w, w.mean(1, keepdim=True)], 1))
        self.m_enc = nn.Sequential(r18.conv1, r18.bn1, r18.relu, r18.maxpool, r18.layer1, r18.layer2, r18.layer3)
        self.key = nn.Conv2d(1024, 128, 3, padding=1)
        self.val = nn.Conv2d(1024 + 256, 512, 3, padding=1)
        self.qval = nn.Conv2d(1024, 512, 3, padding=1)
        # decoder uses BatchNorm; converted to SyncBatchNorm for DDP below
        self.dec = nn.Sequential(
            nn.Conv2d(1024, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(256, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
            nn.Conv2d(128, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, 1, 1))

    def memorize(self, img, mask, q16):
        v = self.m_enc(torch.cat([img, mask[:, None]], 1))
        return self.key(q16), self.val(torch.cat([q16, v], 1))

    def segment(self, q16, mem_k, mem_v):
        qk = self.key(q16)
        b, c, h, w = qk.shape
        aff = torch.bmm(mem_k.transpose(1, 2), qk.flatten(2)) / c ** 0.5
        read = torch.bmm(mem_v, aff.softmax(1)).view(b, -1, h, w)
        logit = self.dec(torch.cat([read, self.qval(q16)], 1))
        return F.interpolate(logit, scale_factor=4, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, frames, first_mask):
        B, T = frames.shape[:2]
        q16 = self.q_enc(frames.flatten(0, 1)).unflatten(0, (B, T))
        k0, v0 = self.memorize(frames[:, 0], first_mask, q16[:, 0])
        mk, mv = [k0.flatten(2)], [v0.flatten(2)]
        logits = []
        for t in range(1, T):
            lg = self.segment(q16[:, t], torch.cat(mk, 2), torch.cat(mv, 2))
            logits.append(lg)
            if t < T - 1:
                k, v = self.memorize(frames[:, t], torch.sigmoid(lg), q16[:, t])
                mk.append(k.flatten(2))
                mv.append(v.flatten(2))
        return torch.stack(logits, 1)


def region_and_contour(pred, gt):
    union = (pred | gt).sum()
    j = 1.0 if union == 0 else (pred & gt).sum() / union
    def edge(m):
        t = torch.from_numpy(m.astype(np.float32))[None, None]
        return (t + F.max_pool2d(-t, 3, 1, 1))[0, 0] > 0
    pe, ge = edge(pred), edge(gt)
    if pe.sum() == 0 and ge.sum() == 0:
        return j, 1.0
    pd = F.max_pool2d(pe[None, None].float(), 7, 1, 3)[0, 0] > 0
    gd = F.max_pool2d(ge[None, None].float(), 7, 1, 3)[0, 0] > 0
    p = (pe & gd).sum().item() / max(pe.sum().item(), 1)
    r = (ge & pd).sum().item() / max(ge.sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def validate(net, args, gpu, rank, world):
    net.eval()
    seqs = open(os.path.join(args.data, "ImageSets/2017/val.txt")).read().split()
    tot = torch.zeros(3, dtype=torch.float64, device=f"cuda:{gpu}")
    tf = lambda im: torchvision.transforms.functional.normalize(torchvision.transforms.functional.to_tensor(im),
                                                                 [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(args.data, "JPEGImages/480p", seq)))
        imgs = torch.stack([tf(Image.open(os.path.join(args.data, "JPEGImages/480p", seq, n)).convert("RGB")
                               .resize((args.size, args.size), Image.BILINEAR)) for n in names]).cuda(gpu)
        gts = np.stack([np.asarray(Image.open(os.path.join(args.data, "Annotations/480p", seq, n[:-4] + ".png"))
                                   .resize((args.size, args.size), Image.NEAREST)) for n in names])
        q16 = net.q_enc(imgs)
        js, fs = [], []
        for obj in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == obj).astype(np.float32)).cuda(gpu)[None]
            k, v = net.memorize(imgs[:1], m0, q16[:1])
            mk, mv = [k.flatten(2)], [v.flatten(2)]
            for t in range(1, len(names)):
                lg = net.segment(q16[t:t + 1], torch.cat(mk, 2), torch.cat(mv, 2))
                pred = (lg[0] > 0).cpu().numpy()
                j, f = region_and_contour(pred, gts[t] == obj)
                js.append(j)
                fs.append(f)
                if t % 5 == 0:
                    k, v = net.memorize(imgs[t:t + 1], torch.sigmoid(lg), q16[t:t + 1])
                    mk.append(k.flatten(2))
                    mv.append(v.flatten(2))
        tot += torch.tensor([np.mean(js), np.mean(fs), 1.0], dtype=torch.float64, device=tot.device)
    dist.all_reduce(tot, op=dist.ReduceOp.SUM)
    net.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.nodes
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = MemNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(gpu)
    per_gpu_batch = args.batch_size // args.world_size
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        ddp.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"], ckpt["best"]
        if rank == 0:
            print(f"=> resumed {args.resume} at epoch {start_epoch}")

    train_set = ConcatDataset([ClipSet(os.path.join(args.data, "JPEGImages/480p"), os.path.join(args.data, "Annotations/480p"), args.size)] * 5
                              + [ClipSet(os.path.join(args.yt, "JPEGImages"), os.path.join(args.yt, "Annotations"), args.size)])
    sampler = DistributedSampler(train_set, num_replicas=args.world_size, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        end = time.time()
        for i, (frames, masks) in enumerate(loader):
            frames, masks = frames.cuda(gpu, non_blocking=True), masks.cuda(gpu, non_blocking=True)
            logits = ddp(frames, masks[:, 0])
            target = masks[:, 1:]
            loss = F.binary_cross_entropy_with_logits(logits, target)
            p = torch.sigmoid(logits)
            loss = loss + (1 - (2 * (p * target).sum((2, 3)) + 1) / (p.sum((2, 3)) + target.sum((2, 3)) + 1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % args.print_freq == 0:
                print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {loss.item():.4f} time {time.time() - end:.3f}", flush=True)
            end = time.time()
        scheduler.step()

        j, f = validate(ddp.module, args, gpu, rank, args.world_size)
        jf = (j + f) / 2
        is_best = jf > best
        best = max(best, jf)
        if rank == 0:
            print(f"Epoch {epoch}: J {j:.4f} F {f:.4f} J&F {jf:.4f} (best {best:.4f})", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"epoch": epoch + 1, "state_dict": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best": best}
            torch.save(state, os.path.join(args.out, "checkpoint.pth.tar"))
            if is_best:
                shutil.copyfile(os.path.join(args.out, "checkpoint.pth.tar"), os.path.join(args.out, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
