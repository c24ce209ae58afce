"""Writer identification from single text lines (IAM) with an ArcFace margin head.

Writers are split disjointly (the training writers are classes of the ArcFace head; the
validation writers are only used for line-level retrieval mAP).

    torchrun --nproc_per_node=4 08_writer_arcface_iam_lines.py --iam /data/IAM --out runs/arcface_lines
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

H, TRAIN_W, EVAL_W = 96, 512, 1536


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iam", required=True)
    ap.add_argument("--out", default="runs/arcface_lines")
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--emb", type=int, default=256)
    ap.add_argument("--scale", type=float, default=30.0)
    ap.add_argument("--margin", type=float, default=0.3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for 256 lines per step, scaled linearly")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def iam_writers(iam_root):
    form_to_writer = {}
    with open(os.path.join(iam_root, "ascii", "forms.txt")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split()
            form_to_writer[parts[0]] = parts[1]
    return form_to_writer


def iam_line_items(iam_root, form_to_writer):
    items = []
    with open(os.path.join(iam_root, "ascii", "lines.txt")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            lid = line.split()[0]
            form = "-".join(lid.split("-")[:2])
            path = os.path.join(iam_root, "lines", lid.split("-")[0], form, lid + ".png")
            items.append((path, int(form_to_writer[form])))
    return items


def load_line(path, width, train):
    img = Image.open(path).convert("L")
    w, h = img.size
    new_w = max(8, round(w * H / h))
    img = img.resize((new_w, H), Image.BILINEAR)
    x = 1.0 - torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
    if new_w >= width:
        off = random.randint(0, new_w - width) if train else (new_w - width) // 2
        x = x[:, off:off + width]
    else:
        x = F.pad(x, (0, width - new_w))
    return x.unsqueeze(0)


class WriterLines(Dataset):
    def __init__(self, items, width, train):
        self.items, self.width, self.train = items, width, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, writer = self.items[i]
        return load_line(path, self.width, self.train), writer, i


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LineEncoder(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.net = nn.Sequential(conv_bn(1, 32), conv_bn(32, 64, 2), conv_bn(64, 64), conv_bn(64, 128, 2),
                                 conv_bn(128, 128), conv_bn(128, 256, 2), conv_bn(256, 256), conv_bn(256, 512, 2))
        self.fc = nn.Sequential(nn.Linear(1024, emb), nn.BatchNorm1d(emb))

    def forward(self, x):
        f = self.net(x)
        f = torch.cat([f.mean(dim=(2, 3)), f.amax(dim=(2, 3))], dim=1)
        return self.fc(f)


class ArcFaceHead(nn.Module):
    def __init__(self, emb, n_classes, s, m):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, emb))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.m = s, m

    def forward(self, emb, labels):
        cos = F.linear(F.normalize(emb), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos)
        target = torch.cos(theta + self.m)
        one_hot = torch.zeros_like(cos).scatter_(1, labels.view(-1, 1), 1.0)
        return self.s * (one_hot * target + (1 - one_hot) * cos)


class Model(nn.Module):
    def __init__(self, emb, n_classes, s, m):
        super().__init__()
        self.encoder = LineEncoder(emb)
        self.arc = ArcFaceHead(emb, n_classes, s, m)

    def forward(self, x, labels):
        return self.arc(self.encoder(x), labels)


def mean_ap(emb, labels):
    emb = F.normalize(emb, dim=1)
    sim = emb @ emb.t()
    sim.fill_diagonal_(-10)
    order = sim.argsort(dim=1, descending=True)[:, :-1]
    rel = (labels[order] == labels[:, None]).float()
    prec = rel.cumsum(1) / torch.arange(1, rel.shape[1] + 1, device=emb.device)
    n = rel.sum(1)
    ok = n > 0
    return ((prec * rel).sum(1)[ok] / n[ok]).mean().item(), rel[ok, 0].mean().item()


@torch.no_grad()
def evaluate(encoder, loader, device, world):
    encoder.eval()
    embs, labs, idxs = [], [], []
    for x, y, i in loader:
        embs.append(encoder(x.to(device)))
        labs.append(y.to(device))
        idxs.append(i.to(device))
    local = [torch.cat(embs), torch.cat(labs), torch.cat(idxs)]
    gathered = []
    for t in local:
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf))
    emb, lab, idx = gathered
    uniq, first = np.unique(idx.cpu().numpy(), return_index=True)
    first = torch.from_numpy(first).to(device)
    encoder.train()
    return mean_ap(emb[first], lab[first])


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    items = iam_line_items(args.iam, iam_writers(args.iam))
    writers = sorted({w for _, w in items})
    split = random.Random(1234)
    val_writers = set(split.sample(writers, int(len(writers) * args.val_frac)))
    train_items = [it for it in items if it[1] not in val_writers]
    val_items = [it for it in items if it[1] in val_writers]
    num_writers = len({w for _, w in train_items})

    train_ds = WriterLines(train_items, TRAIN_W, train=True)
    val_ds = WriterLines(val_items, EVAL_W, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers)

    model = Model(args.emb, num_writers, args.scale, args.margin)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.bs * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    iters = args.epochs * len(train_loader)
    warm = min(1000, iters // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (iters - warm))))

    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        print(f"{len(train_items)} train lines / {num_writers} writers; {len(val_items)} val lines", flush=True)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x, y)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("loss", loss.item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)

        m_ap, top1 = evaluate(model.module.encoder, val_loader, device, world)
        if rank == 0:
            writer.add_scalar("val/mAP", m_ap, epoch)
            writer.add_scalar("val/top1", top1, epoch)
            print(f"epoch {epoch}: mAP {m_ap:.4f} top1 {top1:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if m_ap > best:
                best = m_ap
                torch.save(model.module.encoder.state_dict(), os.path.join(args.out, "encoder_best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
