"""Cross-batch memory (XBM) training on Stanford Online Products.

torchrun --nproc_per_node=4 03_xbm_sop_recall.py --root /data/Stanford_Online_Products \
    --out work_dirs/xbm_sop_r50
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

logger = logging.getLogger("xbm")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="work_dirs/xbm_sop")
    ap.add_argument("--embed-dim", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256, help="global batch")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--xbm-size", type=int, default=55000)
    ap.add_argument("--xbm-start", type=int, default=1000)
    ap.add_argument("--xbm-weight", type=float, default=1.0)
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class SOP(Dataset):
    def __init__(self, root, split, transform):
        fn = "Ebay_train.txt" if split == "train" else "Ebay_test.txt"
        self.root, self.transform = root, transform
        self.paths, labels = [], []
        with open(os.path.join(root, fn)) as f:
            next(f)
            for line in f:
                _, class_id, _, path = line.split()
                self.paths.append(path)
                labels.append(int(class_id))
        base = min(labels)
        self.labels = [l - base for l in labels]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.transform(img), self.labels[i], i


class Embedder(nn.Module):
    def __init__(self, dim, freeze_bn=True):
        super().__init__()
        net = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        net.fc = nn.Identity()
        self.backbone = net
        self.head = nn.Linear(2048, dim)
        self.freeze_bn = freeze_bn

    def train(self, mode=True):
        super().train(mode)
        if self.freeze_bn:
            for m in self.backbone.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, x):
        return F.normalize(self.head(self.backbone(x)), dim=1)


class XBM:
    """FIFO memory of embeddings and labels from all ranks."""

    def __init__(self, size, dim, device):
        self.feats = torch.zeros(size, dim, device=device)
        self.labels = torch.full((size,), -1, dtype=torch.long, device=device)
        self.ptr, self.full, self.size = 0, False, size

    @torch.no_grad()
    def enqueue(self, feats, labels):
        n = feats.shape[0]
        end = self.ptr + n
        if end <= self.size:
            self.feats[self.ptr:end] = feats
            self.labels[self.ptr:end] = labels
        else:
            first = self.size - self.ptr
            self.feats[self.ptr:] = feats[:first]
            self.labels[self.ptr:] = labels[:first]
            self.feats[:n - first] = feats[first:]
            self.labels[:n - first] = labels[first:]
            self.full = True
        self.ptr = end % self.size

    def get(self):
        if self.full:
            return self.feats, self.labels
        return self.feats[:self.ptr], self.labels[:self.ptr]


def contrastive_loss(x, y, ref_x, ref_y, margin, exclude_self=False):
    sim = x @ ref_x.T
    pos = y[:, None] == ref_y[None, :]
    if exclude_self:
        eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
        pos = pos & ~eye
    neg = y[:, None] != ref_y[None, :]
    pos_loss = ((1 - sim) * pos).sum(1)
    neg_loss = (F.relu(sim - margin) * neg).sum(1)
    return (pos_loss + neg_loss).mean()


@torch.no_grad()
def all_gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def embed_split(model, loader, n_items, dim, device):
    model.eval()
    feats, idxs = [], []
    for x, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = model(x.to(device, non_blocking=True))
        feats.append(f.float())
        idxs.append(idx.to(device))
    feats, idxs = all_gather_cat(torch.cat(feats)), all_gather_cat(torch.cat(idxs))
    full = torch.zeros(n_items, dim, device=device)
    full[idxs] = feats  # sampler padding repeats some indices with identical rows
    model.train()
    return full


@torch.no_grad()
def recall_at_k(model, test_set, loader, args, device, ks=(1, 10, 100, 1000)):
    rank, world = dist.get_rank(), dist.get_world_size()
    feats = embed_split(model, loader, len(test_set), args.embed_dim, device)
    labels = torch.tensor(test_set.labels, device=device)
    q_idx = torch.arange(rank, len(test_set), world, device=device)
    hits = [0] * len(ks)
    for chunk in q_idx.split(1024):
        sim = feats[chunk] @ feats.T
        sim[torch.arange(len(chunk), device=device), chunk] = -2.0  # drop the query itself
        topk = sim.topk(max(ks), dim=1).indices
        match = labels[topk] == labels[chunk][:, None]
        for j, k in enumerate(ks):
            hits[j] += match[:, :k].any(1).sum().item()
    counts = torch.tensor(hits + [len(q_idx)], dtype=torch.float64)
    dist.all_reduce(counts)
    return {f"R@{k}": 100.0 * counts[j].item() / counts[-1].item() for j, k in enumerate(ks)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(0)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.16, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_set = SOP(args.root, "train", train_tf)
    test_set = SOP(args.root, "test", test_tf)

    per_gpu = args.batch_size // world
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = Embedder(args.embed_dim).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    params = [{"params": model.module.backbone.parameters(), "lr": args.lr * 0.1},
              {"params": model.module.head.parameters(), "lr": args.lr}]
    optimizer = torch.optim.AdamW(params, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.iters)
    scaler = torch.cuda.amp.GradScaler()
    xbm = XBM(args.xbm_size, args.embed_dim, device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, it, epoch = 0.0, 0, 0
    t0 = time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                emb = model(x)
            emb = emb.float()
            loss = contrastive_loss(emb, y, emb, y, args.margin, exclude_self=True)
            g_emb, g_y = all_gather_cat(emb.detach()), all_gather_cat(y)
            if it >= args.xbm_start:
                xbm.enqueue(g_emb, g_y)
                mem_x, mem_y = xbm.get()
                loss = loss + args.xbm_weight * contrastive_loss(emb, y, mem_x, mem_y, args.margin)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            it += 1

            if it % 50 == 0 and rank == 0:
                logger.info("it %d loss %.4f lr %.2e %.1fs", it, loss.item(), scheduler.get_last_lr()[-1],
                            time.time() - t0)
            if it % args.eval_every == 0 or it == args.iters:
                rec = recall_at_k(model.module, test_set, test_loader, args, device)
                if rank == 0:
                    logger.info("it %d %s", it, " ".join(f"{k} {v:.2f}" for k, v in rec.items()))
                    if rec["R@1"] > best:
                        best = rec["R@1"]
                        torch.save({"model": model.module.state_dict(), "iter": it, "recall": rec},
                                   os.path.join(args.out, "best.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        logger.info("best R@1 %.2f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
