# VideoMAE ViT-B fine-tuning on K400, 16x4 sampling, 5x3 test views.
# Run: torchrun --standalone --nproc_per_node=8 08_videomae_ft_k400.py --data_path /data/k400 \
#          --finetune ckpts/videomae_vit_b_k400_pretrain_1600e.pth --output_dir exps/vitb_k400_ft
#      (add --resume exps/vitb_k400_ft/checkpoint-39.pth to continue a preempted run)
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    parser = argparse.ArgumentParser("VideoMAE fine-tuning and evaluation script for video classification")
    parser.add_argument("--data_path", default="/data/k400")
    parser.add_argument("--output_dir", default="exps/vitb_k400_ft")
    parser.add_argument("--finetune", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--nb_classes", default=400, type=int)
    parser.add_argument("--num_frames", default=16, type=int)
    parser.add_argument("--sampling_rate", default=4, type=int)
    parser.add_argument("--batch_size", default=8, type=int)
    parser.add_argument("--epochs", default=75, type=int)
    parser.add_argument("--warmup_epochs", default=5, type=int)
    parser.add_argument("--lr", default=1e-3, type=float, help="base lr, scaled by total batch / 256")
    parser.add_argument("--min_lr", default=1e-6, type=float)
    parser.add_argument("--weight_decay", default=0.05, type=float)
    parser.add_argument("--drop_path", default=0.1, type=float)
    parser.add_argument("--test_num_segment", default=5, type=int)
    parser.add_argument("--test_num_crop", default=3, type=int)
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--save_ckpt_freq", default=10, type=int)
    return parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.heads, self.drop_path = heads, drop_path
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def _dp(self, x):
        if not self.training or self.drop_path == 0.0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= self.drop_path
        return x * keep / (1.0 - self.drop_path)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + self._dp(self.proj(a))
        return x + self._dp(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class ViTClassifier(nn.Module):
    def __init__(self, num_classes, num_frames=16, dim=768, depth=12, heads=12, drop_path=0.1):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (2, 16, 16), (2, 16, 16))
        n = num_frames // 2 * 196
        table = np.array([[p / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for p in range(n)])
        table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
        self.register_buffer("pos_embed", torch.tensor(table, dtype=torch.float32)[None], persistent=False)
        self.blocks = nn.ModuleList([Block(dim, heads, drop_path * i / (depth - 1)) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.fc_norm(x.mean(1)))


class VideoClsDataset(Dataset):
    def __init__(self, anno_path, data_path, mode, clip_len, frame_sample_rate, test_num_segment=1, test_num_crop=1):
        self.data_path, self.mode = data_path, mode
        self.clip_len, self.rate = clip_len, frame_sample_rate
        self.test_num_segment, self.test_num_crop = test_num_segment, test_num_crop
        with open(anno_path) as f:
            lines = [l.split(" ") for l in f.read().splitlines() if l]
        self.dataset_samples = [l[0] for l in lines]
        self.label_array = [int(l[1]) for l in lines]

    def __len__(self):
        return len(self.dataset_samples)

    def _load(self, fname, start_frac):
        vr = VideoReader(os.path.join(self.data_path, fname), num_threads=1, ctx=cpu(0))
        n, span = len(vr), self.clip_len * self.rate
        start = int(max(n - span, 0) * start_frac)
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        return torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0

    @staticmethod
    def _norm(x):
        m = x.new_tensor([0.485, 0.456, 0.406])[:, None, None, None]
        s = x.new_tensor([0.229, 0.224, 0.225])[:, None, None, None]
        return (x - m) / s

    def __getitem__(self, index):
        fname, label = self.dataset_samples[index], self.label_array[index]
        if self.mode == "train":
            x = self._load(fname, np.random.rand())
            x = F.interpolate(x, scale_factor=float(np.random.uniform(256, 320)) / min(x.shape[-2:]), mode="bilinear")
            h, w = x.shape[-2:]
            i, j = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
            x = x[..., i:i + 224, j:j + 224]
            return self._norm(x.flip(-1) if np.random.rand() < 0.5 else x), label
        views = []
        for s in range(self.test_num_segment):
            x = self._load(fname, s / max(self.test_num_segment - 1, 1))
            x = F.interpolate(x, scale_factor=224 / min(x.shape[-2:]), mode="bilinear")
            h, w = x.shape[-2:]
            for c in range(self.test_num_crop):
                off_h = (h - 224) * c // max(self.test_num_crop - 1, 1) if h > w else 0
                off_w = (w - 224) * c // max(self.test_num_crop - 1, 1) if w >= h else 0
                views.append(self._norm(x[..., off_h:off_h + 224, off_w:off_w + 224]))
        return torch.stack(views), label, index


def adjust_lr(optimizer, epoch, args, base):
    if epoch < args.warmup_epochs:
        lr = base * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (base - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def final_test(model, loader, device, file):
    model.eval()
    lines = []
    for views, target, ids in loader:
        b, v = views.shape[:2]
        with torch.cuda.amp.autocast():
            out = model(views.to(device, non_blocking=True).flatten(0, 1))
        out = out.float().softmax(-1).view(b, v, -1).mean(1).cpu()
        for i in range(b):
            lines.append(f"{ids[i].item()} {target[i].item()} " + " ".join(f"{p:.6f}" for p in out[i].tolist()))
    with open(file, "w") as f:
        f.write("\n".join(lines) + "\n")


def merge(eval_dir, world_size):
    preds = {}
    for r in range(world_size):
        with open(os.path.join(eval_dir, f"{r}.txt")) as f:
            for line in f:
                parts = line.split()
                preds[int(parts[0])] = (int(parts[1]), np.array(parts[2:], dtype=np.float32))
    labels = np.array([v[0] for v in preds.values()])
    scores = np.stack([v[1] for v in preds.values()])
    top5 = np.argsort(-scores, axis=1)[:, :5]
    return (top5[:, 0] == labels).mean() * 100, (top5 == labels[:, None]).any(1).mean() * 100


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    np.random.seed(rank)

    model = ViTClassifier(args.nb_classes, args.num_frames, drop_path=args.drop_path)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        ckpt = {k[8:]: v for k, v in ckpt["model"].items() if k.startswith("encoder.") and "encoder.norm" not in k}
        model.load_state_dict(ckpt, strict=False)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    dataset_train = VideoClsDataset(os.path.join(args.data_path, "train.csv"), args.data_path, "train",
                                    args.num_frames, args.sampling_rate)
    sampler_train = DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True)
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)

    total_batch_size = args.batch_size * world_size
    lr = args.lr * total_batch_size / 256
    decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    loss_scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"Resume checkpoint {args.resume}, start at epoch {start_epoch}")

    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        n_steps = len(data_loader_train)
        t0 = time.time()
        for step, (samples, targets) in enumerate(data_loader_train):
            adjust_lr(optimizer, epoch + step / n_steps, args, lr)
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad()
            loss_scaler.scale(loss).backward()
            loss_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            loss_scaler.step(optimizer)
            loss_scaler.update()
            if rank == 0 and step % 100 == 0:
                print(f"Epoch: [{epoch}] [{step}/{n_steps}] loss: {loss.item():.4f} "
                      f"lr: {optimizer.param_groups[0]['lr']:.6f} time: {time.time() - t0:.0f}s", flush=True)
        if rank == 0 and ((epoch + 1) % args.save_ckpt_freq == 0 or epoch + 1 == args.epochs):
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": loss_scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    dataset_test = VideoClsDataset(os.path.join(args.data_path, "val.csv"), args.data_path, "test", args.num_frames,
                                   args.sampling_rate, args.test_num_segment, args.test_num_crop)
    test_ids = list(range(rank, len(dataset_test), world_size))
    data_loader_test = DataLoader(torch.utils.data.Subset(dataset_test, test_ids), batch_size=2,
                                  num_workers=args.num_workers, pin_memory=True)
    final_test(model_without_ddp, data_loader_test, device, os.path.join(args.output_dir, f"{rank}.txt"))
    dist.barrier()
    if rank == 0:
        top1, top5 = merge(args.output_dir, world_size)
        print(f"* Final {args.test_num_segment}x{args.test_num_crop} views: top1 {top1:.2f} top5 {top5:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
