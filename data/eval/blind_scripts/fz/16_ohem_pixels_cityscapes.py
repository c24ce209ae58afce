"""DeepLabV3 on Cityscapes with pixel-wise online hard example mining (OHEM):
per image-batch only pixels whose gold-class probability is below `--ohem-thresh`
(and at least `--ohem-min-kept` of them) contribute to the loss.

    torchrun --nproc_per_node=8 16_ohem_pixels_cityscapes.py --root /data/cityscapes --iters 40000
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
# Cityscapes label id -> train id (19 classes)
ID_TO_TRAINID = np.full(256, IGNORE, dtype=np.uint8)
for lid, tid in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12,
                 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():
    ID_TO_TRAINID[lid] = tid
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class CityscapesSeg(Dataset):
    def __init__(self, root, split, crop=(768, 768), scale=(0.5, 2.0), train=True):
        self.base = torchvision.datasets.Cityscapes(root, split=split, mode="fine", target_type="semantic")
        self.crop, self.scale, self.train = crop, scale, train

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, lbl = self.base[i]
        lbl = Image.fromarray(ID_TO_TRAINID[np.array(lbl)])
        if self.train:
            s = random.uniform(*self.scale)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img, lbl = img.resize((nw, nh), Image.BILINEAR), lbl.resize((nw, nh), Image.NEAREST)
            if random.random() < 0.5:
                img, lbl = img.transpose(Image.FLIP_LEFT_RIGHT), lbl.transpose(Image.FLIP_LEFT_RIGHT)
        x = torchvision.transforms.functional.to_tensor(img)
        x = (x - MEAN) / STD
        y = torch.from_numpy(np.array(lbl, dtype=np.int64))
        if self.train:
            ch, cw = self.crop
            ph, pw = max(ch - x.shape[1], 0), max(cw - x.shape[2], 0)
            x = F.pad(x, (0, pw, 0, ph))
            y = F.pad(y, (0, pw, 0, ph), value=IGNORE)
            top = random.randint(0, x.shape[1] - ch)
            left = random.randint(0, x.shape[2] - cw)
            x, y = x[:, top:top + ch, left:left + cw], y[top:top + ch, left:left + cw]
        return x, y


def ohem_ce(logits, target, thresh, min_kept):
    pixel_loss = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none").flatten()
    with torch.no_grad():
        prob = logits.softmax(1)
        valid = target != IGNORE
        gold = prob.gather(1, target.clamp(max=logits.size(1) - 1).unsqueeze(1)).squeeze(1)
        gold = gold.masked_fill(~valid, 1.0).flatten()
        n_valid = int(valid.sum())
        k = min(min_kept, n_valid)
        thr = thresh
        if k > 0:
            kth = gold.kthvalue(k).values.item()
            thr = max(thresh, kth)
        keep = (gold < thr) & valid.flatten()
    if keep.sum() == 0:
        return pixel_loss.sum() * 0.0
    return pixel_loss[keep].mean()


def fast_hist(pred, label, n):
    k = label != IGNORE
    return torch.bincount(n * label[k] + pred[k], minlength=n * n).view(n, n)


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)["out"]
        pred = F.interpolate(out.float(), size=y.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
        hist += fast_hist(pred.flatten(), y.flatten(), num_classes)
    return hist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--iters", type=int, default=40000)
    ap.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--ohem-thresh", type=float, default=0.7)
    ap.add_argument("--ohem-min-kept", type=int, default=100000)
    ap.add_argument("--val-every", type=int, default=4000)
    ap.add_argument("--work-dir", default="work_dirs/deeplabv3_ohem")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    num_classes = 19
    train_set = CityscapesSeg(args.root, "train", train=True)
    val_set = CityscapesSeg(args.root, "val", train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1, num_workers=4)

    model = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone="IMAGENET1K_V2", num_classes=num_classes, aux_loss=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    backbone = [p for n, p in model.module.named_parameters() if n.startswith("backbone")]
    head = [p for n, p in model.module.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.SGD([{"params": backbone, "lr": args.lr}, {"params": head, "lr": args.lr * 10}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    scaler = torch.cuda.amp.GradScaler()

    it, epoch, best_miou = 0, 0, 0.0
    model.train()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g, b in zip(optimizer.param_groups, base_lrs):
                g["lr"] = b * (1 - it / args.iters) ** 0.9
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)["out"]
            loss = ohem_ce(logits.float(), y, args.ohem_thresh, args.ohem_min_kept)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            it += 1
            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"iter {it}/{args.iters} loss {l.item():.4f} lr {optimizer.param_groups[0]['lr']:.5f}",
                          flush=True)
            if it % args.val_every == 0 or it == args.iters:
                hist = validate(model.module, val_loader, device, num_classes).double()
                iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
                miou = iou.mean().item()
                if rank == 0:
                    print(f"iter {it}: mIoU {miou:.4f} | " + " ".join(f"{v:.2f}" for v in iou.tolist()), flush=True)
                    os.makedirs(args.work_dir, exist_ok=True)
                    state = {"iter": it, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                    torch.save(state, os.path.join(args.work_dir, "latest.pth"))
                    if miou > best_miou:
                        best_miou = miou
                        torch.save(state, os.path.join(args.work_dir, "best_miou.pth"))
                model.train()
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
