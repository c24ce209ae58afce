"""ConvNeXt-B CLIP on RedCaps (12M reddit image/caption pairs, csv index).

Launch (1 node, 8 GPUs):
    torchrun --nproc_per_node 8 10_convnext_clip_redcaps.py --data-csv /raid/redcaps/index.csv \
        --image-root /raid/redcaps/images --output-dir /raid/runs/convnext_redcaps
"""
import argparse
import logging
import math
import os
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import open_clip


def setup_logging(rank):
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(fmt)
    root = logging.getLogger()
    root.addHandler(h)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class RedCaps(Dataset):
    def __init__(self, csv_file, image_root, transform, tokenizer):
        df = pd.read_csv(csv_file, usecols=["image_id", "subreddit", "caption"])
        self.ids = df["image_id"].astype(str).tolist()
        self.subs = df["subreddit"].tolist()
        self.captions = df["caption"].fillna("").tolist()
        self.root = image_root
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        path = os.path.join(self.root, self.subs[idx], self.ids[idx] + ".jpg")
        img = self.transform(Image.open(path).convert("RGB"))
        return img, self.tokenizer([self.captions[idx]])[0]


def gather_features(img, txt, rank, world):
    gi = [torch.zeros_like(img) for _ in range(world)]
    gt = [torch.zeros_like(txt) for _ in range(world)]
    dist.all_gather(gi, img)
    dist.all_gather(gt, txt)
    gi[rank] = img
    gt[rank] = txt
    return torch.cat(gi), torch.cat(gt)


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        self.rank, self.world = rank, world
        self._labels = {}

    def labels(self, n, device):
        if n not in self._labels:
            self._labels[n] = torch.arange(n, device=device) + n * self.rank
        return self._labels[n]

    def forward(self, img, txt, scale):
        all_img, all_txt = gather_features(img, txt, self.rank, self.world)
        li = scale * img @ all_txt.T
        lt = scale * txt @ all_img.T
        y = self.labels(img.shape[0], img.device)
        loss = (F.cross_entropy(li, y) + F.cross_entropy(lt, y)) / 2
        acc = ((li.argmax(-1) == y).float().mean() + (lt.argmax(-1) == y).float().mean()) / 2
        return loss, acc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-csv", required=True)
    parser.add_argument("--image-root", required=True)
    parser.add_argument("--model", default="convnext_base")
    parser.add_argument("--batch-size", type=int, default=192)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output-dir", default="./runs/convnext_redcaps")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    log = logging.getLogger("train")
    device = torch.device("cuda", local_rank)

    model, preprocess_train, _ = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    raw_model = model.module

    dataset = RedCaps(args.data_csv, args.image_root, preprocess_train, tokenizer)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    opt = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    iters_per_epoch = len(loader)
    warmup_iters = args.warmup_epochs * iters_per_epoch
    total_iters = args.epochs * iters_per_epoch
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=warmup_iters),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_iters - warmup_iters)],
        milestones=[warmup_iters],
    )
    criterion = ClipLoss(rank, world)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ck = torch.load(args.resume, map_location="cpu")
        raw_model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"]
        log.info("resumed from %s, epoch %d", args.resume, start_epoch)

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        log.info("dataset %d pairs, %d iters/epoch, global batch %d", len(dataset), iters_per_epoch,
                 args.batch_size * world)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        meter = torch.zeros(3, device=device)
        t_start = time.time()
        for i, (images, texts) in enumerate(loader):
            it = epoch * iters_per_epoch + i
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = model(images, texts)
                loss, acc = criterion(img_f, txt_f, scale)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                raw_model.logit_scale.clamp_(0, math.log(100))
            meter += torch.stack([loss.detach().float(), acc.detach().float(), torch.ones((), device=device)])

            if rank == 0 and i % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                writer.add_scalar("train/acc", acc.item(), it)
                writer.add_scalar("train/logit_scale", scale.item(), it)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], it)
                log.info("epoch %d iter %d/%d loss %.4f acc %.3f %.1f img/s", epoch, i, iters_per_epoch,
                         loss.item(), acc.item(), (i + 1) * args.batch_size * world / (time.time() - t_start))

        dist.all_reduce(meter)
        if rank == 0:
            writer.add_scalar("epoch/loss", (meter[0] / meter[2]).item(), epoch)
            writer.add_scalar("epoch/acc", (meter[1] / meter[2]).item(), epoch)
            torch.save({"epoch": epoch + 1, "model": raw_model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.output_dir, f"checkpoint_{epoch:03d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
