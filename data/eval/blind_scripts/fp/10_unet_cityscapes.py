"""UNet semantic segmentation on Cityscapes (19 classes), DDP + SyncBatchNorm.

Fault tolerant launch:
    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=localhost:0 10_unet_cityscapes.py --root /data/cityscapes
"""
import argparse
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes

NUM_CLASSES = 19
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

# cityscapes label id -> train id
ID_TO_TRAINID = np.full(256, IGNORE, dtype=np.uint8)
for cid, tid in zip([7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33], range(19)):
    ID_TO_TRAINID[cid] = tid

term_requested = False


def on_sigterm(*_):
    global term_requested
    term_requested = True


class SegTransform:
    def __init__(self, crop, train):
        self.crop, self.train = crop, train

    def __call__(self, img, mask):
        img = np.asarray(img, dtype=np.float32) / 255.0
        mask = ID_TO_TRAINID[np.asarray(mask)]
        if self.train:
            h, w = mask.shape
            y = np.random.randint(0, h - self.crop + 1)
            x = np.random.randint(0, w - self.crop + 1)
            img, mask = img[y:y + self.crop, x:x + self.crop], mask[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1], mask[:, ::-1]
        img = (img - MEAN) / STD
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(mask)).long())


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, n_classes, width=64):
        super().__init__()
        chs = [width * 2 ** i for i in range(5)]
        self.downs = nn.ModuleList([conv_block(3, chs[0])] +
                                   [conv_block(chs[i], chs[i + 1]) for i in range(4)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(4))])
        self.dec = nn.ModuleList([conv_block(chs[i] * 2, chs[i]) for i in reversed(range(4))])
        self.head = nn.Conv2d(chs[0], n_classes, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.ups, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="/mnt/nfs/seg/unet_cityscapes")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--bs", type=int, default=2, help="per GPU (global 16)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--val-every", type=int, default=4000)
    p.add_argument("--ckpt-every", type=int, default=1000)
    return p.parse_args()


def save_checkpoint(path, model, optimizer, it, best_miou):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "iter": it, "best_miou": best_miou}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = model(img).argmax(1)
        valid = mask != IGNORE
        conf += torch.bincount(mask[valid] * NUM_CLASSES + pred[valid],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    np.random.seed(1000 + rank)

    train_set = Cityscapes(args.root, split="train", mode="fine", target_type="semantic",
                           transforms=SegTransform(args.crop, train=True))
    val_set = Cityscapes(args.root, split="val", mode="fine", target_type="semantic",
                         transforms=SegTransform(args.crop, train=False))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True,
                              worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2 ** 32))
    val_loader = DataLoader(val_set, batch_size=1, num_workers=2,
                            sampler=DistributedSampler(val_set, shuffle=False))

    net = nn.SyncBatchNorm.convert_sync_batchnorm(UNet(NUM_CLASSES)).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    ckpt_path = os.path.join(args.out, "last.pth")
    it, best_miou = 0, 0.0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        it, best_miou = ckpt["iter"], ckpt["best_miou"]
        if rank == 0:
            print(f"resuming from iteration {it} (best mIoU {best_miou:.4f})")

    model = DDP(net, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epoch = it // len(train_loader)
    model.train()
    stop = torch.zeros(1, device=device)
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for img, mask in train_loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            lr = args.lr * (1 - it / args.iters) ** 0.9
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss = F.cross_entropy(model(img), mask, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if rank == 0 and it % 50 == 0:
                print(f"iter {it}/{args.iters} loss {loss.item():.4f} lr {lr:.5f} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()

            stop[0] = float(term_requested)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if it % args.val_every == 0:
                miou = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"iter {it} mIoU {miou:.4f}", flush=True)
                    if miou > best_miou:
                        best_miou = miou
                        torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
            if stop.item() or it % args.ckpt_every == 0 or it == args.iters:
                if rank == 0:
                    save_checkpoint(ckpt_path, model, optimizer, it, best_miou)
                dist.barrier()
            if stop.item() or it >= args.iters:
                break
        if stop.item():
            if rank == 0:
                print(f"SIGTERM: checkpoint at iteration {it}, exiting")
            break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
