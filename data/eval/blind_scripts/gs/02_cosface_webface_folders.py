#!/usr/bin/env python
# CosFace (m=0.4) on WebFace-style folders: <root>/<identity>/<image>.jpg
# The classifier is split across GPUs by identity, the backbone is data parallel.
import argparse
import logging
import math
import os
import pickle
import sys
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from backbones.iresnet import iresnet50

log = logging.getLogger(__name__)


class FaceFolderDataset(Dataset):
    """Aligned 112x112 crops listed in a text file, one relative path per line."""

    def __init__(self, root, list_file, transform):
        self.root = root
        self.transform = transform
        with open(list_file) as f:
            rel_paths = [line.strip() for line in f if line.strip()]
        identities = list({p.split("/")[0] for p in rel_paths})
        self.class_to_idx = {name: i for i, name in enumerate(identities)}
        self.samples = [(p, self.class_to_idx[p.split("/")[0]]) for p in rel_paths]

    @property
    def num_classes(self):
        return len(self.class_to_idx)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *buffers):
        buffers = list(buffers)
        dist.all_gather(buffers, tensor)
        return tuple(buffers)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        rank = dist.get_rank()
        works = []
        for i, g in enumerate(grads):
            works.append(dist.reduce(g, i, dist.ReduceOp.SUM, async_op=True))
        for w in works:
            w.wait()
        grad_out = grads[rank] * len(grads)
        return (grad_out, *[None] * len(grads))


class _DistSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        n = logits.size(0)
        max_logit = logits.max(dim=1, keepdim=True)[0]
        dist.all_reduce(max_logit, dist.ReduceOp.MAX)
        logits.sub_(max_logit).exp_()
        denom = logits.sum(dim=1, keepdim=True)
        dist.all_reduce(denom, dist.ReduceOp.SUM)
        logits.div_(denom)
        index = torch.where(label != -1)[0]
        prob = torch.zeros(n, 1, device=logits.device)
        prob[index] = logits[index].gather(1, label[index])
        dist.all_reduce(prob, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, logits, label)
        return -prob.clamp_min_(1e-30).log_().mean()

    @staticmethod
    def backward(ctx, grad):
        index, logits, label = ctx.saved_tensors
        n = logits.size(0)
        one_hot = torch.zeros((index.size(0), logits.size(1)), device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(n)
        return logits * grad.item(), None


class CosFaceHead(nn.Module):
    def __init__(self, embedding_size, num_classes, s=64.0, m=0.4):
        super().__init__()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.s, self.m = s, m
        self.embedding_size = embedding_size
        per, rem = divmod(num_classes, self.world)
        self.num_local = per + int(self.rank < rem)
        self.class_start = per * self.rank + min(self.rank, rem)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))

    def forward(self, emb, label):
        bs = emb.size(0)
        emb_bufs = [torch.zeros(bs, self.embedding_size, device=emb.device) for _ in range(self.world)]
        lab_bufs = [torch.zeros(bs, dtype=torch.long, device=emb.device) for _ in range(self.world)]
        all_emb = torch.cat(_AllGather.apply(emb, *emb_bufs))
        dist.all_gather(lab_bufs, label)
        all_lab = torch.cat(lab_bufs).view(-1, 1)

        mine = (all_lab >= self.class_start) & (all_lab < self.class_start + self.num_local)
        all_lab[~mine] = -1
        all_lab[mine] -= self.class_start

        cos = F.linear(F.normalize(all_emb), F.normalize(self.weight)).clamp(-1, 1)
        idx = torch.where(all_lab != -1)[0]
        cos[idx, all_lab[idx].view(-1)] -= self.m
        return _DistSoftmaxCE.apply(cos * self.s, all_lab)


@torch.no_grad()
def lfw_accuracy(model, bin_path, device):
    with open(bin_path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    feats = []
    for start in range(0, len(bins), 200):
        batch = []
        for b in bins[start:start + 200]:
            img = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1]
            batch.append(torch.from_numpy(img.transpose(2, 0, 1).copy()))
        x = torch.stack(batch).to(device).float().div_(255).sub_(0.5).div_(0.5)
        f = model(x) + model(x.flip(3))
        feats.append(F.normalize(f).cpu())
    feats = torch.cat(feats)
    sims = (feats[0::2] * feats[1::2]).sum(1).numpy()
    issame = np.asarray(issame)
    return max(((sims > t) == issame).mean() for t in np.linspace(-1, 1, 400))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/webface/aligned_112")
    ap.add_argument("--list", default="/data/webface/train_list.txt")
    ap.add_argument("--lfw", default="/data/webface/lfw.bin")
    ap.add_argument("--out", default="./runs/cosface_r50_webface")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=34)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--milestones", type=int, nargs="+", default=[20, 28, 32])
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    os.makedirs(args.out, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    tf = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    dataset = FaceFolderDataset(args.root, args.list, tf)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    log.info("%d images, %d identities, %d GPUs", len(dataset), dataset.num_classes, world)

    model = iresnet50(num_features=512).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    head = CosFaceHead(512, dataset.num_classes).to(device)

    # lr is tuned for a global batch of 512
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": head.parameters()}],
                          lr=lr, momentum=0.9, weight_decay=args.wd)
    iters_per_epoch = len(loader)
    sched = torch.optim.lr_scheduler.MultiStepLR(
        opt, milestones=[m * iters_per_epoch for m in args.milestones], gamma=0.1)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for imgs, labels in loader:
            imgs = imgs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = head(model(imgs), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=5)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                ips = 100 * args.batch_size * world / (time.time() - t0)
                t0 = time.time()
                log.info("ep %d it %d loss %.4f lr %.4f %.0f img/s", epoch, step, loss.item(),
                         sched.get_last_lr()[0], ips)
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            if step % args.eval_every == 0:
                if rank == 0:
                    model.module.eval()
                    acc = lfw_accuracy(model.module, args.lfw, device)
                    model.module.train()
                    log.info("step %d LFW %.4f", step, acc)
                    writer.add_scalar("val/lfw", acc, step)
                dist.barrier()

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, f"backbone_ep{epoch}.pt"))
        torch.save(head.state_dict(), os.path.join(args.out, f"head_ep{epoch}_rank{rank}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
