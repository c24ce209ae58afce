# VideoMAE ViT-B fine-tuning on UCF101 / HMDB51 with wandb tracking.
#   torchrun --nproc_per_node=4 15_videomae_ft_wandb.py --dataset ucf101 --data_root /data/ucf101 \
#       --finetune ckpts/videomae_vitb_k400_ft.pth --wandb_project video-ft
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

NUM_CLASSES = {"ucf101": 101, "hmdb51": 51}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=list(NUM_CLASSES), default="ucf101")
    p.add_argument("--data_root", required=True)
    p.add_argument("--split", type=int, default=1)
    p.add_argument("--finetune", default="")
    p.add_argument("--output_dir", default="exps/vitb_ucf101")
    p.add_argument("--num_frames", type=int, default=16)
    p.add_argument("--sampling_rate", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup_epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--wandb_project", default="video-ft")
    p.add_argument("--run_name", default=None)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads, dp):
        super().__init__()
        self.heads, self.dp = heads, dp
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def _drop(self, x):
        if self.training and self.dp > 0:
            return x * torch.empty(x.shape[0], 1, 1, device=x.device).bernoulli_(1 - self.dp) / (1 - self.dp)
        return x

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self._drop(self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)))
        return x + self._drop(self.mlp(self.norm2(x)))


class VideoMAEClassifier(nn.Module):
    def __init__(self, num_classes, num_frames=16, dim=768, depth=12, heads=12, drop_path=0.2):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (2, 16, 16), (2, 16, 16))
        n = num_frames // 2 * 196
        pos = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)
        pos[:, 0::2] = np.sin(pos[:, 0::2])
        pos[:, 1::2] = np.cos(pos[:, 1::2])
        self.register_buffer("pos_embed", torch.from_numpy(pos).float()[None], persistent=False)
        self.blocks = nn.ModuleList([Block(dim, heads, drop_path * i / (depth - 1)) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.fc_norm(x.mean(dim=1)))


class SplitVideos(Dataset):
    def __init__(self, root, dataset, split, train, num_frames, rate):
        self.root, self.train, self.num_frames, self.rate = root, train, num_frames, rate
        ann = os.path.join(root, "annotations", f"{dataset}_{'train' if train else 'test'}_split{split}.txt")
        with open(ann) as f:
            self.items = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, "videos", rel), ctx=cpu(0), num_threads=1)
        n = len(vr)
        span = self.num_frames * self.rate
        rate = self.rate if n >= span else max(1, n // self.num_frames)
        span = self.num_frames * rate
        start = np.random.randint(0, max(n - span, 0) + 1) if self.train else max(n - span, 0) // 2
        idx = np.minimum(np.arange(start, start + span, rate), n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        x = F.interpolate(x, scale_factor=(np.random.uniform(224, 288) if self.train else 224) / min(x.shape[-2:]),
                          mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            t, l = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
        else:
            t, l = (h - 224) // 2, (w - 224) // 2
        x = x[..., t:t + 224, l:l + 224]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
        return (x - mean) / std, label


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    res = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(x)
        top5 = logits.topk(5, dim=-1).indices
        res[0] += (top5[:, 0] == y).sum()
        res[1] += (top5 == y[:, None]).any(-1).sum()
        res[2] += y.numel()
    dist.all_reduce(res)
    return (res[0] / res[2] * 100).item(), (res[1] / res[2] * 100).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    model = VideoMAEClassifier(NUM_CLASSES[args.dataset], args.num_frames)
    if args.finetune:
        sd = torch.load(args.finetune, map_location="cpu")
        sd = sd.get("model", sd.get("module", sd))
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("missing", missing, "unexpected", unexpected)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_set = SplitVideos(args.data_root, args.dataset, args.split, True, args.num_frames, args.sampling_rate)
    test_set = SplitVideos(args.data_root, args.dataset, args.split, False, args.num_frames, args.sampling_rate)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 256
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1]
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    iters = len(train_loader)
    warm, total = args.warmup_epochs * iters, args.epochs * iters
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            step = epoch * iters + it
            cur = lr * step / warm if step < warm else 0.5 * lr * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if it % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": cur, "train/grad_norm": grad_norm.item(),
                           "epoch": epoch}, step=step)

        top1, top5 = evaluate(model.module, test_loader, device)
        wandb.log({"val/top1": top1, "val/top5": top5, "epoch_time": time.time() - t0}, step=(epoch + 1) * iters)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.output_dir, "checkpoint-last.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.output_dir, "checkpoint-best.pth"))
                run.summary["best_top1"] = best

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
