"""Fine-tune a Glint360K R100 on masked / occluded faces with a fresh sharded CosFace classifier.

    torchrun --nproc_per_node=8 finetune_masked.py \
        --pretrained /mnt/models/glint360k_r100/model.pt --data /data/masked_faces/train
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from backbones import get_model
from partial_fc_v2 import AllGather, DistCrossEntropy
from utils.utils_callbacks import CallBackVerification

logger = logging.getLogger("masked-ft")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-rec", default="/data/masked_faces/val")
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--network", default="r100")
    ap.add_argument("--output", default="work_dirs/masked_ft_r100")
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--head-lr-mult", type=float, default=10.0)
    ap.add_argument("--freeze-epochs", type=int, default=1)
    ap.add_argument("--margin", type=float, default=0.35)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class ShardedCosFace(nn.Module):
    def __init__(self, embedding_size, num_classes, s=64.0, m=0.35):
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.embedding_size = embedding_size
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.s, self.m = s, m
        self.dist_cross_entropy = DistCrossEntropy()

    def forward(self, local_embeddings, local_labels):
        bs = local_embeddings.size(0)
        _gather_embeddings = [torch.zeros((bs, self.embedding_size), device=local_embeddings.device)
                              for _ in range(self.world_size)]
        _gather_labels = [torch.zeros(bs, dtype=torch.long, device=local_labels.device)
                          for _ in range(self.world_size)]
        embeddings = torch.cat(AllGather(local_embeddings, *_gather_embeddings))
        dist.all_gather(_gather_labels, local_labels)
        labels = torch.cat(_gather_labels).view(-1, 1)

        index_positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start

        logits = F.linear(F.normalize(embeddings), F.normalize(self.weight)).clamp(-1, 1)
        index = torch.where(labels != -1)[0]
        logits[index, labels[index].view(-1)] -= self.m
        return self.dist_cross_entropy(logits * self.s, labels)


def build_loader(args):
    tf = transforms.Compose([
        transforms.Resize((112, 112)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    ])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    return ds, sampler, loader


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    ds, sampler, loader = build_loader(args)
    num_classes = len(ds.classes)
    logger.info("%d images of %d identities", len(ds), num_classes)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).to(device)
    pretrained = torch.load(args.pretrained)
    backbone.load_state_dict(pretrained)
    logger.info("loaded %s", args.pretrained)
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)

    head = ShardedCosFace(512, num_classes, m=args.margin).to(device)
    opt = torch.optim.SGD([
        {"params": backbone.parameters(), "lr": args.lr},
        {"params": head.parameters(), "lr": args.lr * args.head_lr_mult},
    ], momentum=0.9, weight_decay=5e-4)
    total_steps = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, eta_min=1e-5)
    scaler = torch.cuda.amp.GradScaler(growth_interval=200)

    verifier = CallBackVerification(val_targets=["masked_lfw", "masked_agedb"], rec_prefix=args.val_rec)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        warm = epoch < args.freeze_epochs
        tic = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = head(backbone(img), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if warm:
                # only the new classifier and the embedding layer move during the first epoch
                for name, p in backbone.module.named_parameters():
                    if not name.startswith(("fc.", "features.")):
                        p.grad = None
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.6f %.0f img/s", epoch, step, total_steps,
                            loss.item(), sched.get_last_lr()[0],
                            50 * args.batch_size * world_size / (time.time() - tic))
                tic = time.time()
            if step % 1000 == 0:
                verifier(step, backbone)

        torch.save(head.state_dict(), os.path.join(args.output, f"head_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, f"model_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
