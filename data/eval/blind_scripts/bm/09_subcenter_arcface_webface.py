"""Sub-center ArcFace (K=3) on CASIA-WebFace, record-file input.

Noisy web-collected identities: each class keeps K sub-centres and the target
logit is the max over them, so outlier images attach to a non-dominant centre.

    torchrun --nproc_per_node=4 09_subcenter_arcface_webface.py --rec /data/faces_webface_112x112
"""
import argparse
import math
import numbers
import os
import pickle
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms as T

from backbones import get_model


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/data/faces_webface_112x112")
    ap.add_argument("--num-classes", type=int, default=10572)
    ap.add_argument("--network", default="r50")
    ap.add_argument("--k", type=int, default=3, help="sub-centres per class")
    ap.add_argument("--s", type=float, default=64.0)
    ap.add_argument("--m", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--milestones", type=int, nargs="+", default=[20, 28, 32])
    ap.add_argument("--output", default="runs/subcenter_webface")
    return ap.parse_args()


class RecordDataset(Dataset):
    def __init__(self, root):
        self.rec = mx.recordio.MXIndexedRecordIO(os.path.join(root, "train.idx"),
                                                 os.path.join(root, "train.rec"), "r")
        header, _ = mx.recordio.unpack(self.rec.read_idx(0))
        self.keys = list(range(1, int(header.label[0]))) if header.flag > 0 else list(self.rec.keys)
        self.tf = T.Compose([T.ToPILImage(), T.RandomHorizontalFlip(), T.ToTensor(),
                             T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        header, buf = mx.recordio.unpack(self.rec.read_idx(self.keys[i]))
        label = header.label if isinstance(header.label, numbers.Number) else header.label[0]
        return self.tf(mx.image.imdecode(buf).asnumpy()), int(label)


class SubCenterArcFace(nn.Module):
    def __init__(self, emb, num_classes, k=3, s=64.0, m=0.5):
        super().__init__()
        self.k, self.s, self.m = k, s, m
        self.weight = nn.Parameter(torch.empty(num_classes * k, emb))
        nn.init.xavier_uniform_(self.weight)
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, label):
        cos_all = F.linear(F.normalize(x), F.normalize(self.weight))
        cos = cos_all.view(x.size(0), -1, self.k).max(dim=2).values.clamp(-1 + 1e-7, 1 - 1e-7)
        sin = torch.sqrt(1.0 - cos * cos)
        phi = cos * self.cos_m - sin * self.sin_m
        phi = torch.where(cos > self.th, phi, cos - self.mm)
        onehot = F.one_hot(label, cos.size(1)).to(cos.dtype)
        return self.s * (onehot * phi + (1 - onehot) * cos)


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.backbone = get_model(args.network, num_features=512)
        self.margin = SubCenterArcFace(512, args.num_classes, args.k, args.s, args.m)

    def forward(self, x, y):
        return self.margin(self.backbone(x).float(), y)


def load_val(rec_root, name):
    with open(os.path.join(rec_root, f"{name}.bin"), "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    imgs = np.stack([mx.image.imdecode(b).asnumpy() for b in bins]).transpose(0, 3, 1, 2)
    return (torch.from_numpy(imgs).float() / 127.5 - 1.0), np.asarray(issame)


@torch.no_grad()
def verify(backbone, imgs, issame, device):
    backbone.eval()
    emb = torch.cat([F.normalize(backbone(b.to(device)) + backbone(b.flip(3).to(device))).cpu()
                     for b in imgs.split(500)])
    backbone.train()
    sim = (emb[0::2] * emb[1::2]).sum(1).numpy()
    ths = np.sort(sim)
    accs = [np.mean((sim >= t) == issame) for t in ths[::10]]
    return float(np.max(accs))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    dataset = RecordDataset(args.rec)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    model = DDP(Model(args).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, 0.1)
    criterion = nn.CrossEntropyLoss()

    writer = None
    val = {}
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(args.output)
        val = {n: load_val(args.rec, n) for n in ("lfw", "cfp_fp", "agedb_30")}

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        tic = time.time()
        for step, (img, label) in enumerate(loader):
            img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True)
            logits = model(img, label)
            loss = criterion(logits, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            loss_sum += loss.item() * img.size(0)
            correct += (logits.argmax(1) == label).sum().item()
            seen += img.size(0)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / (step + 1):.3f}s/it", flush=True)
        scheduler.step()

        stats = torch.tensor([loss_sum, correct, seen], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        train_loss = (stats[0] / stats[2]).item()
        train_acc = (stats[1] / stats[2]).item()

        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/acc", train_acc, epoch)
            msg = f"epoch {epoch}: loss {train_loss:.4f} acc {train_acc:.4f}"
            for name, (imgs, issame) in val.items():
                acc = verify(model.module.backbone, imgs, issame, device)
                writer.add_scalar(f"val/{name}", acc, epoch)
                msg += f" {name} {acc:.4f}"
            print(msg, flush=True)
            torch.save({"backbone": model.module.backbone.state_dict(),
                        "margin": model.module.margin.state_dict(), "epoch": epoch},
                       os.path.join(args.output, f"epoch_{epoch:02d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
