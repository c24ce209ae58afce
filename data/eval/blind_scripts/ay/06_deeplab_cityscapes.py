#!/usr/bin/env python3
"""DeepLabV3-ResNet101 on Cityscapes fine, 768x768 crops, channels_last + bf16 + torch.compile.

    torchrun --nproc_per_node=8 06_deeplab_cityscapes.py --root /datasets/cityscapes --out /shared/seg/dlv3_r101
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF

NUM_CLASSES = 19
IGNORE = 255
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

# cityscapes id -> train id
ID_TO_TRAIN = np.full(256, IGNORE, dtype=np.uint8)
for cid, tid in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10,
                 24: 11, 25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():
    ID_TO_TRAIN[cid] = tid


class JointTransform:
    def __init__(self, train, crop=768, scale=(0.5, 2.0)):
        self.train, self.crop, self.scale = train, crop, scale

    def __call__(self, img, target):
        target = Image.fromarray(ID_TO_TRAIN[np.asarray(target)])
        if self.train:
            s = random.uniform(*self.scale)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img = img.resize((nw, nh), Image.BILINEAR)
            target = target.resize((nw, nh), Image.NEAREST)
            pw, ph = max(self.crop - nw, 0), max(self.crop - nh, 0)
            if pw or ph:
                img = TF.pad(img, [0, 0, pw, ph], fill=0)
                target = TF.pad(target, [0, 0, pw, ph], fill=IGNORE)
            i = random.randint(0, img.size[1] - self.crop)
            j = random.randint(0, img.size[0] - self.crop)
            img = TF.crop(img, i, j, self.crop, self.crop)
            target = TF.crop(target, i, j, self.crop, self.crop)
            if random.random() < 0.5:
                img, target = TF.hflip(img), TF.hflip(target)
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(target), dtype=torch.int64)


def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    for img, tgt in loader:
        img = img.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        tgt = tgt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(img)["out"]
        cm += confusion(out.argmax(1), tgt, NUM_CLASSES)
    dist.all_reduce(cm)
    iou = cm.diag().float() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1).float()
    net.train()
    return iou.mean().item(), iou.tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    ap.add_argument("--iters", type=int, default=40_000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--aux-weight", type=float, default=0.4)
    ap.add_argument("--eval-every", type=int, default=4_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True
    seed = 1234 + rank
    random.seed(seed)
    torch.manual_seed(seed)

    train_set = torchvision.datasets.Cityscapes(args.root, split="train", mode="fine", target_type="semantic",
                                                transforms=JointTransform(train=True))
    val_set = torchvision.datasets.Cityscapes(args.root, split="val", mode="fine", target_type="semantic",
                                              transforms=JointTransform(train=False))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided split of the 500 val images, no padding so each image is counted once
    val_shard = Subset(val_set, range(rank, len(val_set), dist.get_world_size()))
    val_loader = DataLoader(val_shard, batch_size=1, num_workers=4, pin_memory=True)

    model = torchvision.models.segmentation.deeplabv3_resnet101(
        weights=None, weights_backbone="IMAGENET1K_V2", num_classes=NUM_CLASSES, aux_loss=True)
    model = model.to(device, memory_format=torch.channels_last)
    ddp_model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    fwd = torch.compile(ddp_model)

    backbone = [p for n, p in model.named_parameters() if n.startswith("backbone")]
    heads = [p for n, p in model.named_parameters() if not n.startswith("backbone")]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr}, {"params": heads, "lr": args.lr * 10}],
                          momentum=0.9, weight_decay=args.wd, nesterov=False, fused=True)
    base_lrs = [g["lr"] for g in opt.param_groups]

    it = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        it = ck["iter"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epoch = it // len(train_loader)
    best = 0.0
    t0 = time.perf_counter()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, tgt in train_loader:
            img = img.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            tgt = tgt.to(device, non_blocking=True)
            factor = (1 - it / args.iters) ** 0.9
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * factor
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(img)
            loss = F.cross_entropy(out["out"].float(), tgt, ignore_index=IGNORE)
            loss = loss + args.aux_weight * F.cross_entropy(out["aux"].float(), tgt, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1

            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.perf_counter() - t0) / 50
                    ips = args.batch_size * dist.get_world_size() / dt
                    print(f"it {it}/{args.iters} loss {l.item():.4f} lr {opt.param_groups[0]['lr']:.5f} "
                          f"{dt:.3f}s/it {ips:.1f} img/s", flush=True)
                t0 = time.perf_counter()

            if it % args.eval_every == 0 or it == args.iters:
                miou, per_class = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"it {it}: mIoU {miou * 100:.2f}", flush=True)
                    state = {"model": model.state_dict(), "opt": opt.state_dict(), "iter": it, "miou": miou}
                    torch.save(state, os.path.join(args.out, "last.pth"))
                    if miou > best:
                        best = miou
                        torch.save(state, os.path.join(args.out, "best.pth"))
                dist.barrier()
                t0 = time.perf_counter()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
