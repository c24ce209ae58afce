"""SegFormer-B2 fine-tuning on ADE20K with gradient accumulation (no_sync on the inner steps).

    python -m torch.distributed.launch --use_env --nproc_per_node=8 train_segformer.py \
        --data /data/ADEChallengeData2016 --init checkpoints/segformer_b2_inhouse_pretrain.pth
"""
import argparse
import contextlib
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import SegformerConfig, SegformerForSemanticSegmentation

NUM_CLASSES = 150
IGNORE = 255


class ADE20K(Dataset):
    def __init__(self, root, split, crop=512, train=True):
        sub = "training" if split == "train" else "validation"
        self.imgs = sorted(glob.glob(os.path.join(root, "images", sub, "*.jpg")))
        self.anns = [p.replace("images", "annotations").replace(".jpg", ".png") for p in self.imgs]
        self.crop, self.train = crop, train
        self.mean = np.array([123.675, 116.28, 103.53], dtype=np.float32)
        self.std = np.array([58.395, 57.12, 57.375], dtype=np.float32)

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        ann = Image.open(self.anns[i])
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            r = 512 * s / min(w, h)
            img = img.resize((int(w * r), int(h * r)), Image.BILINEAR)
            ann = ann.resize((int(w * r), int(h * r)), Image.NEAREST)
        img = (np.asarray(img, dtype=np.float32) - self.mean) / self.std
        lbl = np.asarray(ann, dtype=np.int64) - 1          # reduce_zero_label
        lbl[lbl < 0] = IGNORE
        if self.train:
            ph, pw = max(self.crop - lbl.shape[0], 0), max(self.crop - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - self.crop), random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), torch.from_numpy(np.ascontiguousarray(lbl))


def load_init(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    # the in-house pre-training run saved the DDP wrapper's state_dict
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("decode_head.classifier")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.float64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        logits = model(pixel_values=img).logits
        pred = F.interpolate(logits, size=lbl.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(NUM_CLASSES * lbl[k] + pred[k], minlength=NUM_CLASSES ** 2) \
            .view(NUM_CLASSES, NUM_CLASSES).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    model.train()
    return torch.nanmean(iou).item(), (hist.diag().sum() / hist.sum()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--batch-per-gpu", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1, help="keeps the global batch at 16 on fewer GPUs")
    ap.add_argument("--lr", type=float, default=6e-5, help="for global batch 16")
    ap.add_argument("--iters", type=int, default=160000)
    ap.add_argument("--eval-every", type=int, default=16000)
    ap.add_argument("--work-dir", default="work_dirs/segformer_b2_ade")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    cfg = SegformerConfig.from_pretrained("nvidia/mit-b2", num_labels=NUM_CLASSES)
    model = SegformerForSemanticSegmentation(cfg)
    if args.init:
        missing, unexpected = load_init(model, args.init)
        if rank == 0:
            print(f"init from {args.init}: missing {len(missing)} unexpected {len(unexpected)}")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = ADE20K(args.data, "train")
    val_set = ADE20K(args.data, "val", train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1, num_workers=2)

    global_batch = args.batch_per_gpu * world * args.accum
    lr = args.lr * global_batch / 16
    head = [p for n, p in model.module.named_parameters() if n.startswith("decode_head")]
    enc = [p for n, p in model.module.named_parameters() if not n.startswith("decode_head")]
    optimizer = torch.optim.AdamW([{"params": enc, "lr": lr}, {"params": head, "lr": lr * 10}],
                                  lr=lr, weight_decay=0.01)
    poly = lambda it: (1 - it / args.iters) ** 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}")

    it, epoch, micro = 0, 0, 0
    model.train()
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            micro += 1
            sync = micro % args.accum == 0
            ctx = contextlib.nullcontext() if sync else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(pixel_values=img).logits
                    logits = F.interpolate(logits, size=lbl.shape[-2:], mode="bilinear", align_corners=False)
                    loss = F.cross_entropy(logits.float(), lbl, ignore_index=IGNORE)
                (loss / args.accum).backward()
            if not sync:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            it += 1
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"iter {it}/{args.iters} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                    t0 = time.time()
            if it % args.eval_every == 0 or it == args.iters:
                miou, acc = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"iter {it}: mIoU {miou:.4f} aAcc {acc:.4f}", flush=True)
                    torch.save({"iter": it, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                               os.path.join(args.work_dir, f"iter_{it}.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
