"""
MSMT17 re-ID training (ResNet50-IBN style baseline, GeM pooling, BNNeck).

launch:
    torchrun --nproc_per_node=8 03_msmt_gem_ddp.py --data /datasets/MSMT17_V1 --out runs/msmt_gem
"""
import argparse
import os
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models import resnet50


def get_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/msmt")
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="images per identity")
    ap.add_argument("--lr", type=float, default=3.5e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--milestones", type=int, nargs="+", default=[30, 50])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eval-interval", type=int, default=5)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=42)
    return ap


def read_list(root, list_file, img_dir):
    """MSMT17 list files: '<pid>/<file>.jpg <pid>'; camera is in the file name."""
    items = []
    with open(os.path.join(root, list_file)) as f:
        for line in f:
            rel, pid = line.split()
            camid = int(rel.split("_")[2]) - 1
            items.append((os.path.join(root, img_dir, rel), int(pid), camid))
    return items


class MSMT(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pid, cam = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class PKBatchSampler(Sampler):
    """Yields whole P x K batches. Each epoch a shuffled list of batches is
    drawn from the same seed on every rank, and rank r keeps batches r, r+W, ..."""

    def __init__(self, items, batch_size, k, rank, world, seed):
        self.k, self.rank, self.world, self.seed = k, rank, world, seed
        self.p = batch_size // k
        self.epoch = 0
        self.index = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.index[pid].append(i)
        self.pids = sorted(self.index)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _all_batches(self):
        rnd = random.Random(self.seed * 1000 + self.epoch)
        pools = {}
        for pid in self.pids:
            idx = self.index[pid][:]
            if len(idx) < self.k:
                idx = idx + [rnd.choice(idx) for _ in range(self.k - len(idx))]
            rnd.shuffle(idx)
            pools[pid] = [idx[j:j + self.k] for j in range(0, len(idx) - self.k + 1, self.k)]
        live = self.pids[:]
        batches = []
        while len(live) >= self.p:
            batch = []
            for pid in rnd.sample(live, self.p):
                batch += pools[pid].pop()
                if not pools[pid]:
                    live.remove(pid)
            batches.append(batch)
        usable = len(batches) - len(batches) % self.world
        return batches[:usable]

    def __iter__(self):
        yield from self._all_batches()[self.rank::self.world]

    def __len__(self):
        total = sum(max(len(v), self.k) // self.k for v in self.index.values())
        return (total // self.p) // self.world


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p)


class ReIDNet(nn.Module):
    def __init__(self, num_classes, pretrained):
        super().__init__()
        r = resnet50()
        if pretrained:
            r.load_state_dict(torch.load(pretrained, map_location="cpu"), strict=False)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.pool = GeM()
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.fc = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.fc.weight, std=0.001)

    def forward(self, x):
        g = self.pool(self.body(x)).flatten(1)
        b = self.bnneck(g)
        return (self.fc(b), g) if self.training else b


def triplet_hard(x, y, margin=0.3):
    d = torch.cdist(x, x)
    pos = y.unsqueeze(1) == y.unsqueeze(0)
    hardest_pos = (d * pos).max(1).values
    hardest_neg = d.masked_fill(pos, 1e9).min(1).values
    return F.margin_ranking_loss(hardest_neg, hardest_pos, torch.ones_like(hardest_neg), margin=margin)


def mean_ap(dmat, qp, gp, qc, gc):
    idx = np.argsort(dmat, axis=1)
    aps, r1 = [], []
    for i in range(dmat.shape[0]):
        o = idx[i]
        valid = (gp[o] != qp[i]) | (gc[o] != qc[i])
        m = gp[o][valid] == qp[i]
        if not m.any():
            continue
        hits = np.cumsum(m)
        aps.append(np.sum(hits[m] / (np.nonzero(m)[0] + 1)) / m.sum())
        r1.append(float(m[0]))
    return float(np.mean(aps)), float(np.mean(r1))


@torch.no_grad()
def embed(model, loader, device):
    model.eval()
    fs, ps, cs = [], [], []
    for img, pid, cam in loader:
        fs.append(F.normalize(model(img.to(device)), dim=1))
        ps.append(pid)
        cs.append(cam)
    return torch.cat(fs), torch.cat(ps).numpy(), torch.cat(cs).numpy()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    train = read_list(args.data, "list_train.txt", "train") + read_list(args.data, "list_val.txt", "train")
    query = read_list(args.data, "list_query.txt", "test")
    gallery = read_list(args.data, "list_gallery.txt", "test")
    num_classes = max(p for _, p, _ in train) + 1

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((384, 128)),
                          T.ColorJitter(0.2, 0.15, 0.1), T.ToTensor(), norm, T.RandomErasing()])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])

    batch_sampler = PKBatchSampler(train, args.global_batch // world, args.k, rank, world, args.seed)
    train_loader = DataLoader(MSMT(train, train_tf), batch_sampler=batch_sampler,
                              num_workers=args.workers, pin_memory=True)
    q_loader = DataLoader(MSMT(query, test_tf), batch_size=128, num_workers=4,
                          sampler=DistributedSampler(query, shuffle=False))
    g_loader = DataLoader(MSMT(gallery, test_tf), batch_size=128, num_workers=4,
                          sampler=DistributedSampler(gallery, shuffle=False))

    net = ReIDNet(num_classes, pretrained=os.path.join(args.data, "..", "pretrained", "resnet50-0676ba61.pth"))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: (e + 1) / args.warmup if e < args.warmup else 0.1 ** sum(e >= m for m in args.milestones))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    writer = SummaryWriter(args.out) if rank == 0 else None

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, pid, _ in train_loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(img)
            l_ce, l_tri = ce(logits, pid), triplet_hard(feat, pid)
            loss = l_ce + l_tri
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0:
                logged = torch.stack([l_ce.detach(), l_tri.detach()])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("loss/id", logged[0].item(), step)
                    writer.add_scalar("loss/triplet", logged[1].item(), step)
        sched.step()
        if rank == 0:
            print(f"[{epoch + 1}/{args.epochs}] {time.time() - t0:.0f}s lr={sched.get_last_lr()[0]:.2e}", flush=True)

        if (epoch + 1) % args.eval_interval == 0:
            qf, qp, qc = embed(net, q_loader, device)
            gf, gp, gc = embed(net, g_loader, device)
            dmat = (1.0 - qf @ gf.T).cpu().numpy()
            mAP, rank1 = mean_ap(dmat, qp, gp, qc, gc)
            if rank == 0:
                print(f"    mAP {mAP * 100:.2f}  rank-1 {rank1 * 100:.2f}", flush=True)
                writer.add_scalar("eval/mAP", mAP, epoch + 1)
                writer.add_scalar("eval/rank1", rank1, epoch + 1)
                torch.save({"state_dict": net.state_dict(), "epoch": epoch + 1}, os.path.join(args.out, "last.pth"))
                if mAP > best:
                    best = mAP
                    torch.save({"state_dict": net.state_dict(), "epoch": epoch + 1, "mAP": mAP},
                               os.path.join(args.out, "best.pth"))
            dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
