"""PHOCNet (TPP) for segmentation-based keyword spotting on George Washington / IAM words.

Reports query-by-example (QbE) and query-by-string (QbS) mAP on the test words; the
PHOC predictions of all ranks are gathered before retrieval.

    torchrun --nproc_per_node=4 20_phocnet_kws_gw.py --words data/gw/words --fold 1 --out runs/phocnet_gw
"""
import argparse
import os
import string
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.spatial.distance import cdist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ALPHABET = string.ascii_lowercase + string.digits
LEVELS = (2, 3, 4, 5)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", required=True, help="folder with images/ and cv{fold}_{train,test}.txt")
    ap.add_argument("--fold", type=int, default=1)
    ap.add_argument("--out", default="runs/phocnet_gw")
    ap.add_argument("--iterations", type=int, default=80000)
    ap.add_argument("--batch-size", type=int, default=10, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


def phoc(word):
    word = word.lower()
    vec = []
    n = len(word)
    for level in LEVELS:
        for region in range(level):
            r0, r1 = region / level, (region + 1) / level
            bits = np.zeros(len(ALPHABET), dtype=np.float32)
            for i, ch in enumerate(word):
                if ch not in ALPHABET:
                    continue
                c0, c1 = i / n, (i + 1) / n
                overlap = max(0.0, min(c1, r1) - max(c0, r0))
                if overlap / (c1 - c0) >= 0.5:
                    bits[ALPHABET.index(ch)] = 1
            vec.append(bits)
    return np.concatenate(vec)


def read_split(root, fold, name):
    items = []
    with open(os.path.join(root, f"cv{fold}_{name}.txt"), encoding="utf-8") as f:
        for line in f:
            fn, word = line.split()
            items.append((os.path.join(root, "images", fn), word.lower()))
    return items


class WordImages(Dataset):
    def __init__(self, items, train):
        self.items, self.train = items, train
        self.phocs = np.stack([phoc(w) for _, w in items])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(self.items[i][0]).convert("L")
        if self.train:  # random scale keeps aspect ratio roughly, as in the PHOCNet paper
            s = np.random.uniform(0.8, 1.2)
            img = img.resize((max(16, int(img.width * s * np.random.uniform(0.9, 1.1))),
                              max(16, int(img.height * s))), Image.BILINEAR)
        x = 1.0 - np.asarray(img, dtype=np.float32) / 255.0
        return torch.from_numpy(x)[None], torch.from_numpy(self.phocs[i]), i


def pad_batch(batch):
    xs, ys, idx = zip(*batch)
    Hm, Wm = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    out = torch.zeros(len(xs), 1, Hm, Wm)
    for k, x in enumerate(xs):
        out[k, :, : x.shape[1], : x.shape[2]] = x
    return out, torch.stack(ys), torch.tensor(idx)


class TPP(nn.Module):
    def __init__(self, levels=(1, 2, 3, 4, 5)):
        super().__init__()
        self.levels = levels

    def forward(self, x):
        return torch.cat([F.adaptive_max_pool2d(x, (1, l)).flatten(1) for l in self.levels], dim=1)


class PHOCNet(nn.Module):
    def __init__(self, n_out):
        super().__init__()

        def convs(cin, cout, n):
            layers = []
            for i in range(n):
                layers += [nn.Conv2d(cin if i == 0 else cout, cout, 3, padding=1), nn.ReLU(inplace=True)]
            return layers

        self.conv = nn.Sequential(*convs(1, 64, 2), nn.MaxPool2d(2), *convs(64, 128, 2), nn.MaxPool2d(2),
                                  *convs(128, 256, 6), *convs(256, 512, 3))
        self.tpp = TPP()
        self.fc = nn.Sequential(nn.Linear(512 * 15, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                nn.Linear(4096, n_out))

    def forward(self, x):
        return self.fc(self.tpp(self.conv(x)))


def average_precision(dist_row, rel):
    order = np.argsort(dist_row)
    r = rel[order]
    if r.sum() == 0:
        return None
    prec = np.cumsum(r) / np.arange(1, len(r) + 1)
    return float((prec * r).sum() / r.sum())


def kws_map(pred, words, gt_phocs):
    words = np.array(words)
    D = cdist(pred, pred, "cosine")
    aps = []
    for q in range(len(words)):
        rel = (words == words[q]).astype(np.float32)
        rel[q] = 0
        d = D[q].copy()
        d[q] = np.inf
        ap = average_precision(d, rel)
        if ap is not None:
            aps.append(ap)
    qbe = float(np.mean(aps))
    uniq, first = np.unique(words, return_index=True)
    Ds = cdist(gt_phocs[first], pred, "cosine")
    qbs = float(np.mean([average_precision(Ds[k], (words == w).astype(np.float32)) for k, w in enumerate(uniq)]))
    return qbe, qbs


@torch.no_grad()
def evaluate(model, loader, test_ds, device, world):
    model.eval()
    preds, idxs = [], []
    for x, _, i in loader:
        preds.append(torch.sigmoid(model(x.to(device))))
        idxs.append(i.to(device))
    preds, idxs = torch.cat(preds), torch.cat(idxs)
    P = [torch.empty_like(preds) for _ in range(world)]
    I = [torch.empty_like(idxs) for _ in range(world)]
    dist.all_gather(P, preds)
    dist.all_gather(I, idxs)
    idx = torch.cat(I).cpu().numpy()
    pred = torch.cat(P).cpu().numpy()
    idx, keep = np.unique(idx, return_index=True)
    pred = pred[keep]
    words = [test_ds.items[i][1] for i in idx]
    model.train()
    return kws_map(pred, words, test_ds.phocs[idx])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    train_ds = WordImages(read_split(args.words, args.fold, "train"), train=True)
    test_ds = WordImages(read_split(args.words, args.fold, "test"), train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=pad_batch, pin_memory=True, drop_last=True,
                              worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2**32))
    test_loader = DataLoader(test_ds, batch_size=1, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, collate_fn=pad_batch)

    model = DDP(PHOCNet(train_ds.phocs.shape[1]).to(device), device_ids=[args.local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, betas=(0.9, 0.999), weight_decay=5e-5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[args.iterations * 3 // 4], gamma=0.1)

    it, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y, reduction="sum") / x.shape[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 500 == 0:
                print(f"iter {it} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
            if it % args.eval_every == 0 or it == args.iterations:
                qbe, qbs = evaluate(model, test_loader, test_ds, device, world)
                if rank == 0:
                    print(f"iter {it}: QbE mAP {qbe:.4f}  QbS mAP {qbs:.4f}", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "iter": it, "qbe": qbe, "qbs": qbs},
                               os.path.join(args.out, "last.pt"))
                    if qbe > best:
                        best = qbe
                        torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                dist.barrier()
            if it >= args.iterations:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
