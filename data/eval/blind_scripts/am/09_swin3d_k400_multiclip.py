"""Video Swin-T (torchvision swin3d_t) on Kinetics-400.

* each video is decoded once and `--clips-per-video` random clips are cut from it
  (the clips are flattened into the batch, labels repeated)
* unreadable videos are replaced inside the dataset, so every rank sees full batches
* fp16 autocast + GradScaler, gradient accumulation, EMA of the weights

torchrun --nproc_per_node=8 09_swin3d_k400_multiclip.py --data /data/k400 --accum 2
"""
import argparse
import logging
import math
import os
import random
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from decord import VideoReader, cpu
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision.models.video import Swin3D_T_Weights, swin3d_t

logger = logging.getLogger("swin3d")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1, 1)


class KineticsMultiClip(Dataset):
    def __init__(self, root, ann, train, clips_per_video=2, num_frames=32, stride=2, size=224):
        with open(ann) as f:
            self.rows = [ln.split() for ln in f if ln.strip()]
        self.root, self.train, self.k = root, train, clips_per_video if train else 1
        self.num_frames, self.stride, self.size = num_frames, stride, size

    def __len__(self):
        return len(self.rows)

    def _sample(self, vr):
        n, span = len(vr), self.num_frames * self.stride
        starts = ([random.randint(0, max(n - span, 0)) for _ in range(self.k)] if self.train
                  else [max(n - span, 0) // 2])
        idx = [min(s + j * self.stride, n - 1) for s in starts for j in range(self.num_frames)]
        frames = torch.from_numpy(vr.get_batch(idx).asnumpy()).float().div_(255)   # k*T H W C
        frames = frames.view(self.k, self.num_frames, *frames.shape[1:]).permute(0, 4, 1, 2, 3)
        return frames                                                              # k C T H W

    def _augment(self, x):
        k, c, t, h, w = x.shape
        x = x.reshape(k, c * t, h, w)
        out = []
        for clip in x:
            if self.train:
                area = h * w * random.uniform(0.3, 1.0)
                ar = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
                ch, cw = min(h, int(round(math.sqrt(area / ar)))), min(w, int(round(math.sqrt(area * ar))))
                y0, x0 = random.randint(0, h - ch), random.randint(0, w - cw)
                clip = clip[:, y0:y0 + ch, x0:x0 + cw]
                if random.random() < 0.5:
                    clip = clip.flip(-1)
            else:
                s = min(h, w)
                clip = clip[:, (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
            out.append(F.interpolate(clip[None], size=(self.size, self.size), mode="bilinear",
                                     align_corners=False)[0])
        x = torch.stack(out).view(k, c, t, self.size, self.size)
        return (x - MEAN) / STD

    def __getitem__(self, i):
        for _ in range(20):
            rel, label = self.rows[i]
            try:
                vr = VideoReader(os.path.join(self.root, rel), ctx=cpu(0), num_threads=2)
                return self._augment(self._sample(vr)), int(label)
            except Exception as e:
                logger.warning("skip %s (%s)", rel, e)
                i = random.randrange(len(self.rows))
        raise RuntimeError("20 consecutive unreadable videos")


def seed_worker(worker_id):
    random.seed(torch.initial_seed() % 2 ** 32)


def cosine_with_warmup(optimizer, warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.flatten(0, 1).to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            top5 = net(x).topk(5, -1).indices
        acc[0] += (top5[:, 0] == y).sum()
        acc[1] += (top5 == y[:, None]).any(-1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2] * 100).item(), (acc[1] / acc[2] * 100).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="work_dirs/swin3d_t_k400")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4, help="videos per GPU per micro-step")
    ap.add_argument("--clips-per-video", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3, help="for 64 videos per optimizer step")
    ap.add_argument("--ema", type=float, default=0.9998)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    random.seed(rank * 1000 + 1)

    train_set = KineticsMultiClip(os.path.join(args.data, "videos"), os.path.join(args.data, "train.txt"),
                                  True, args.clips_per_video)
    val_set = KineticsMultiClip(os.path.join(args.data, "videos"), os.path.join(args.data, "val.txt"), False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True,
                              worker_init_fn=seed_worker)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=8,
                            num_workers=args.workers, pin_memory=True)

    model = swin3d_t(weights=Swin3D_T_Weights.KINETICS400_V1).to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    ema = ModelEmaV2(model, decay=args.ema)

    videos_per_step = args.batch_size * args.accum * world
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or "relative_position_bias_table" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr * videos_per_step / 64, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader) // args.accum
    scheduler = cosine_with_warmup(optimizer, 2 * steps_per_epoch, args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler()

    ckpt_path = os.path.join(args.out, "last.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(state["model"])
        ema.module.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1
        logger.info("resumed at epoch %d", start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            if it >= steps_per_epoch * args.accum:
                break
            x = x.flatten(0, 1).to(device, non_blocking=True)                # (B*k) C T H W
            y = y.repeat_interleave(args.clips_per_video).to(device, non_blocking=True)
            boundary = (it + 1) % args.accum == 0
            with (nullcontext() if boundary else ddp.no_sync()):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(ddp(x), y, label_smoothing=0.1)
                scaler.scale(loss / args.accum).backward()
            if boundary:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                ema.update(model)
            if rank == 0 and it % 100 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.2e %.2fs/it", epoch, it, len(train_loader),
                            loss.item(), scheduler.get_last_lr()[0], (time.time() - t0) / (it + 1))

        top1, top5 = evaluate(model, val_loader, device)
        etop1, etop5 = evaluate(ema.module, val_loader, device)
        logger.info("epoch %d  top1 %.2f top5 %.2f | ema top1 %.2f top5 %.2f", epoch, top1, top5, etop1, etop5)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "top1": top1, "ema_top1": etop1},
                       ckpt_path + ".part")
            os.replace(ckpt_path + ".part", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
