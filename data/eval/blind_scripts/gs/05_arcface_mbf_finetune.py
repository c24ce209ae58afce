# Fine-tune a MobileFaceNet (pretrained on WebFace42M) on an in-house ID set with ArcFace.
# torchrun --nproc_per_node=4 finetune_mbf.py --data /data/faces/inhouse_v3 --pretrained mbf_webface42m.pt
import argparse
import logging
import math
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("finetune")


class ConvBlock(nn.Module):
    def __init__(self, in_c, out_c, k=1, s=1, p=0, g=1, act=True):
        super().__init__()
        layers = [nn.Conv2d(in_c, out_c, k, s, p, groups=g, bias=False), nn.BatchNorm2d(out_c)]
        if act:
            layers.append(nn.PReLU(out_c))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


class DepthWise(nn.Module):
    def __init__(self, in_c, out_c, residual=False, k=3, s=2, p=1, groups=1):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBlock(in_c, groups, 1),
            ConvBlock(groups, groups, k, s, p, g=groups),
            ConvBlock(groups, out_c, 1, act=False),
        )

    def forward(self, x):
        y = self.layers(x)
        return x + y if self.residual else y


class Residual(nn.Module):
    def __init__(self, c, num_block, groups):
        super().__init__()
        self.layers = nn.Sequential(*[DepthWise(c, c, True, 3, 1, 1, groups) for _ in range(num_block)])

    def forward(self, x):
        return self.layers(x)


class MobileFaceNet(nn.Module):
    def __init__(self, embedding_size=512, scale=2, blocks=(1, 4, 6, 2)):
        super().__init__()
        self.embedding_size = embedding_size
        c1, c2 = 64 * scale, 128 * scale
        self.layers = nn.Sequential(
            ConvBlock(3, c1, 3, 2, 1),
            ConvBlock(c1, c1, 3, 1, 1, g=c1),
            DepthWise(c1, c1, False, 3, 2, 1, 128),
            Residual(c1, blocks[1], 128),
            DepthWise(c1, c2, False, 3, 2, 1, 256),
            Residual(c2, blocks[2], 256),
            DepthWise(c2, c2, False, 3, 2, 1, 512),
            Residual(c2, blocks[3], 256),
        )
        self.conv_sep = ConvBlock(c2, 512, 1)
        self.gdc = ConvBlock(512, 512, 7, 1, 0, g=512, act=False)
        self.fc = nn.Linear(512, embedding_size, bias=False)
        self.features = nn.BatchNorm1d(embedding_size)

    def forward(self, x):
        x = self.conv_sep(self.layers(x))
        x = self.gdc(x).flatten(1)
        return self.features(self.fc(x))

    @torch.no_grad()
    def embed(self, x):
        return F.normalize(self.forward(x) + self.forward(torch.flip(x, dims=[3])))


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        rank = dist.get_rank()
        works = [dist.reduce(g, i, dist.ReduceOp.SUM, async_op=True) for i, g in enumerate(grads)]
        for w in works:
            w.wait()
        return (grads[rank] * len(grads), *[None] * len(grads))


class ShardedArcFace(nn.Module):
    """ArcFace classifier whose class centers are split over the ranks."""

    def __init__(self, embedding_size, num_classes, s=64.0, m=0.5):
        super().__init__()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.embedding_size = embedding_size
        self.num_local = num_classes // self.world + int(self.rank < num_classes % self.world)
        self.class_start = num_classes // self.world * self.rank + min(self.rank, num_classes % self.world)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.s, self.m = s, m

    def forward(self, emb, labels):
        bs = emb.size(0)
        bufs = [torch.empty(bs, self.embedding_size, device=emb.device) for _ in range(self.world)]
        lab_bufs = [torch.empty(bs, dtype=torch.long, device=emb.device) for _ in range(self.world)]
        emb_all = torch.cat(AllGather.apply(emb, *bufs))
        dist.all_gather(lab_bufs, labels)
        lab = torch.cat(lab_bufs)

        local = (lab >= self.class_start) & (lab < self.class_start + self.num_local)
        lab_local = torch.where(local, lab - self.class_start, torch.full_like(lab, -1))
        idx = torch.where(local)[0]

        cos = F.linear(F.normalize(emb_all), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos[idx, lab_local[idx]])
        cos[idx, lab_local[idx]] = torch.cos(theta + self.m)
        return DistSoftmaxCE.apply(cos * self.s, lab_local.view(-1, 1))


class DistSoftmaxCE(torch.autograd.Function):
    """Cross entropy over the classes of every rank."""

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
        index, probs, label = ctx.saved_tensors
        one_hot = torch.zeros((index.size(0), probs.size(1)), device=probs.device)
        one_hot.scatter_(1, label[index], 1)
        probs[index] -= one_hot
        probs.div_(probs.size(0))
        return probs * grad.item(), None


def load_pairs(path):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    imgs = [cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1].transpose(2, 0, 1) for b in bins]
    return torch.from_numpy(np.stack(imgs).copy()), np.asarray(issame)


@torch.no_grad()
def verify(model, imgs, issame, device):
    model.eval()
    feats = []
    for i in range(0, len(imgs), 256):
        x = imgs[i:i + 256].to(device).float().div(127.5).sub(1.0)
        feats.append(model.embed(x).cpu())
    model.train()
    feats = torch.cat(feats)
    sims = (feats[0::2] * feats[1::2]).sum(1).numpy()
    return max(((sims > t) == issame).mean() for t in np.arange(-0.5, 1.0, 0.002))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-bin", default="/data/faces/val/inhouse_pairs.bin")
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--out", default="work_dirs/mbf_finetune")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr-backbone", type=float, default=0.01)
    ap.add_argument("--lr-head", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.out, exist_ok=True)

    train_tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(args.data, transform=train_tf)
    num_classes = len(train_set.classes)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    backbone = MobileFaceNet(embedding_size=512)
    backbone.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    backbone = DDP(backbone.to(device), device_ids=[local_rank], broadcast_buffers=False)
    head = ShardedArcFace(512, num_classes).to(device)

    opt = torch.optim.SGD([
        {"params": backbone.parameters(), "lr": args.lr_backbone},
        {"params": head.parameters(), "lr": args.lr_head},
    ], momentum=0.9, weight_decay=1e-4)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr_backbone, args.lr_head],
                                                total_steps=total_steps, pct_start=0.05)

    val = load_pairs(args.val_bin) if rank == 0 else None
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for img, lab in loader:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = head(backbone(img), lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f %.1f it/s", epoch, step, total_steps, loss.item(),
                            50 / (time.time() - tic))
                tic = time.time()
            if step % args.eval_every == 0:
                if rank == 0:
                    acc = verify(backbone, *val, device)
                    logger.info("step %d pair accuracy %.4f", step, acc)
                    if acc > best:
                        best = acc
                        torch.save(backbone.module.state_dict(), os.path.join(args.out, "best.pt"))
                dist.barrier()
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.out, f"epoch_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
