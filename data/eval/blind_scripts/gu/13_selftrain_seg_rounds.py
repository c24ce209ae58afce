"""Round-based self-training for GTA5 -> Cityscapes semantic segmentation (DDP).

Every round:
  1. each rank predicts its slice of the Cityscapes train images; per-class
     confidence histograms are summed over ranks to pick class-balanced thresholds,
  2. each rank writes pseudo-label PNGs for its own slice (ignore=255 below threshold),
  3. the model is fine-tuned on GTA5 + pseudo-labelled Cityscapes.

Per-GPU batches are tiny (2 crops), so BatchNorm is synchronised across GPUs.

    torchrun --nproc_per_node=8 13_selftrain_seg_rounds.py --gta /data/gta5 \
        --cityscapes /data/cityscapes --init ckpt/gta5_source_deeplabv3.pth --work /shared/st_runs/exp1
"""
import argparse
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
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50

NC, IGNORE, BINS = 19, 255, 1000
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SegList(Dataset):
    """Reads `image_path label_path` pairs; crops/flips jointly when `crop` is set."""

    def __init__(self, pairs, crop=None, size=(1024, 512)):
        self.pairs, self.crop, self.size = pairs, crop, size

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        img_p, lbl_p = self.pairs[i]
        img = Image.open(img_p).convert("RGB").resize(self.size, Image.BICUBIC)
        img = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        if lbl_p is not None:
            lbl = np.asarray(Image.open(lbl_p).resize(self.size, Image.NEAREST), dtype=np.int64)
        else:
            lbl = np.full(img.shape[:2], IGNORE, dtype=np.int64)
        if self.crop:
            ch, cw = self.crop
            y0 = random.randint(0, img.shape[0] - ch)
            x0 = random.randint(0, img.shape[1] - cw)
            img, lbl = img[y0:y0 + ch, x0:x0 + cw], lbl[y0:y0 + ch, x0:x0 + cw]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        return img, torch.from_numpy(np.ascontiguousarray(lbl)), i


def read_pairs(list_file, root, with_labels=True):
    pairs = []
    with open(list_file) as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            img = os.path.join(root, parts[0])
            lbl = os.path.join(root, parts[1]) if with_labels and len(parts) > 1 else None
            pairs.append((img, lbl))
    return pairs


def rank_slice(ds, rank, world):
    return Subset(ds, list(range(rank, len(ds), world)))


@torch.no_grad()
def predict_probs(net, x):
    return F.softmax(net(x)["out"], dim=1)


@torch.no_grad()
def make_pseudo_labels(net, pairs, out_dir, portion, rank, world, device):
    net.eval()
    shard = rank_slice(SegList(pairs), rank, world)
    loader = DataLoader(shard, batch_size=2, num_workers=4, pin_memory=True)
    hist = torch.zeros(NC, BINS, device=device)
    for x, _, _ in loader:
        conf, pred = predict_probs(net, x.to(device, non_blocking=True)).max(1)
        bins = (conf * (BINS - 1)).long()
        hist.index_put_((pred.flatten(), bins.flatten()), torch.ones_like(conf.flatten()), accumulate=True)
    dist.all_reduce(hist)

    # threshold per class: confidence above which the top `portion` of its pixels lie
    cum = hist.flip(1).cumsum(1) / hist.sum(1, keepdim=True).clamp(min=1)
    first = (cum >= portion).float().argmax(1)
    thr = ((BINS - 1 - first).float() / (BINS - 1)).clamp(max=0.9)

    os.makedirs(out_dir, exist_ok=True)
    kept = torch.zeros(2, device=device)
    for x, _, idx in loader:
        conf, pred = predict_probs(net, x.to(device, non_blocking=True)).max(1)
        pred[conf < thr[pred]] = IGNORE
        kept += torch.stack([(pred != IGNORE).sum().float(), torch.tensor(float(pred.numel()), device=device)])
        for k, i in enumerate(idx.tolist()):
            name = os.path.basename(pairs[shard.indices[i]][0]).replace(".png", "_pl.png")
            Image.fromarray(pred[k].byte().cpu().numpy()).save(os.path.join(out_dir, name))
    dist.all_reduce(kept)
    net.train()
    return thr, (kept[0] / kept[1]).item()


@torch.no_grad()
def evaluate(net, pairs, rank, world, device):
    net.eval()
    loader = DataLoader(rank_slice(SegList(pairs), rank, world), batch_size=2, num_workers=4)
    cm = torch.zeros(NC * NC, dtype=torch.long, device=device)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        pred = net(x)["out"].argmax(1)
        valid = y != IGNORE
        cm += torch.bincount(y[valid] * NC + pred[valid], minlength=NC * NC)
    dist.all_reduce(cm)
    cm = cm.view(NC, NC).float()
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
    net.train()
    return iou.mean().item() * 100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gta", default="/data/gta5")
    ap.add_argument("--cityscapes", default="/data/cityscapes")
    ap.add_argument("--init", required=True)
    ap.add_argument("--work", required=True, help="shared directory for pseudo-labels and checkpoints")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters-per-round", type=int, default=8000)
    ap.add_argument("--portions", type=float, nargs="+", default=[0.2, 0.4, 0.5])
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--crop", type=int, nargs=2, default=[512, 512])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    gta_pairs = read_pairs(os.path.join(args.gta, "train.txt"), args.gta)
    cs_train = read_pairs(os.path.join(args.cityscapes, "train.txt"), args.cityscapes, with_labels=False)
    cs_val = read_pairs(os.path.join(args.cityscapes, "val.txt"), args.cityscapes)

    net = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=NC, aux_loss=False)
    net.load_state_dict(torch.load(args.init, map_location="cpu")["model"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD([
        {"params": net.backbone.parameters(), "lr": args.lr},
        {"params": net.classifier.parameters(), "lr": 10 * args.lr},
    ], momentum=0.9, weight_decay=5e-4)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    miou = evaluate(net, cs_val, rank, world, device)
    if rank == 0:
        print(f"init mIoU {miou:.2f}", flush=True)

    for rnd in range(args.rounds):
        pl_dir = os.path.join(args.work, f"round{rnd}", "pseudo")
        portion = args.portions[min(rnd, len(args.portions) - 1)]
        thr, kept = make_pseudo_labels(net, cs_train, pl_dir, portion, rank, world, device)
        dist.barrier()  # all PNGs of this round are on disk before anyone reads them
        if rank == 0:
            print(f"round {rnd}: portion {portion}, kept {100 * kept:.1f}% px, "
                  f"thr min/max {thr.min():.2f}/{thr.max():.2f}", flush=True)

        pl_pairs = [(img, os.path.join(pl_dir, os.path.basename(img).replace(".png", "_pl.png")))
                    for img, _ in cs_train]
        train_set = ConcatDataset([SegList(gta_pairs, crop=args.crop), SegList(pl_pairs, crop=args.crop)])
        sampler = DistributedSampler(train_set, shuffle=True, seed=rnd, drop_last=True)
        loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)

        it, epoch, t0 = 0, 0, time.time()
        model.train()
        while it < args.iters_per_round:
            sampler.set_epoch(epoch)
            for x, y, _ in loader:
                if it >= args.iters_per_round:
                    break
                for g, lr in zip(optimizer.param_groups, base_lrs):
                    g["lr"] = lr * (1 - it / args.iters_per_round) ** 0.9
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x)["out"], y, ignore_index=IGNORE)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if it % 200 == 0:
                    l = loss.detach().clone()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"round {rnd} it {it}: loss {l:.4f} ({time.time() - t0:.0f}s)", flush=True)
                it += 1
            epoch += 1

        miou = evaluate(net, cs_val, rank, world, device)
        if rank == 0:
            print(f"round {rnd}: Cityscapes val mIoU {miou:.2f}", flush=True)
            torch.save({"model": net.state_dict(), "round": rnd, "miou": miou},
                       os.path.join(args.work, f"round{rnd}", "model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
