"""EfficientAD-S training for one product line (student-teacher + autoencoder).

The PDN teacher is distilled from WideResNet features beforehand
(teacher_small.pth); here we train the student and the autoencoder on the
nominal images of the line, then compute the quantile normalisation used by
the inline inspection service.

    torchrun --nproc_per_node=8 train_efficientad.py --line connector_x12 \
        --data /nfs/aoi/lines --teacher /nfs/aoi/models/teacher_small.pth \
        --imagenet /nfs/datasets/imagenet/train --out /nfs/aoi/models/efficientad
"""
import argparse
import itertools
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

OUT_CH = 384
SIZE = 256

default_tf = transforms.Compose([transforms.Resize((SIZE, SIZE)), transforms.ToTensor(),
                                 transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
ae_aug = transforms.RandomChoice([transforms.ColorJitter(brightness=0.2), transforms.ColorJitter(contrast=0.2),
                                  transforms.ColorJitter(saturation=0.2)])


def pdn_small(out_ch=OUT_CH, padding=False):
    p = 1 if padding else 0
    return nn.Sequential(
        nn.Conv2d(3, 128, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(128, 256, 4, padding=3 * p), nn.ReLU(inplace=True), nn.AvgPool2d(2, 2, padding=p),
        nn.Conv2d(256, 256, 3, padding=p), nn.ReLU(inplace=True),
        nn.Conv2d(256, out_ch, 4))


def autoencoder(out_ch=OUT_CH):
    enc = [nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(True), nn.Conv2d(32, 32, 4, 2, 1), nn.ReLU(True),
           nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True),
           nn.Conv2d(64, 64, 4, 2, 1), nn.ReLU(True), nn.Conv2d(64, 64, 8)]
    dec = []
    for s in (3, 8, 15, 32, 63, 127):
        dec += [nn.Upsample(size=s, mode="bilinear"), nn.Conv2d(64, 64, 4, 1, 2), nn.ReLU(True), nn.Dropout(0.2)]
    dec += [nn.Upsample(size=56, mode="bilinear"), nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(True),
            nn.Conv2d(64, out_ch, 3, 1, 1)]
    return nn.Sequential(*enc, *dec)


class StudentAE(nn.Module):
    """Student (2*OUT_CH outputs) and autoencoder trained jointly under one DDP wrapper."""

    def __init__(self):
        super().__init__()
        self.student = pdn_small(2 * OUT_CH, padding=True)
        self.ae = autoencoder()

    def forward(self, x_st, x_ae, x_pen):
        return self.student(x_st), self.ae(x_ae), self.student(x_ae), self.student(x_pen)


class LineDataset(Dataset):
    def __init__(self, root):
        self.files = sorted(Path(root).glob("*.png"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return default_tf(img), default_tf(ae_aug(img))


@torch.no_grad()
def teacher_normalization(teacher, loader, device):
    s, sq, n = 0.0, 0.0, 0
    for x, _ in loader:
        t = teacher(x.to(device))
        s = s + t.sum(dim=(0, 2, 3))
        sq = sq + (t ** 2).sum(dim=(0, 2, 3))
        n += t.shape[0] * t.shape[2] * t.shape[3]
    stats = torch.cat([s, sq, torch.tensor([float(n)], device=device)])
    dist.all_reduce(stats)
    mean = stats[:OUT_CH] / stats[-1]
    std = (stats[OUT_CH:2 * OUT_CH] / stats[-1] - mean ** 2).clamp_min(1e-8).sqrt()
    return mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)


@torch.no_grad()
def predict(x, teacher, model, t_mean, t_std, q=None):
    t = (teacher(x) - t_mean) / t_std
    s = model.student(x)
    ae = model.ae(x)
    map_st = torch.mean((t - s[:, :OUT_CH]) ** 2, dim=1, keepdim=True)
    map_ae = torch.mean((ae - s[:, OUT_CH:]) ** 2, dim=1, keepdim=True)
    if q is not None:
        map_st = 0.1 * (map_st - q["a_st"]) / (q["b_st"] - q["a_st"])
        map_ae = 0.1 * (map_ae - q["a_ae"]) / (q["b_ae"] - q["a_ae"])
    return map_st, map_ae


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--line", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--imagenet", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=70000)
    ap.add_argument("--ckpt-every", type=int, default=5000)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    line_dir = Path(args.data) / args.line
    out_dir = Path(args.out) / args.line
    out_dir.mkdir(parents=True, exist_ok=True)

    train_ds = LineDataset(line_dir / "train" / "good")
    sampler = DistributedSampler(train_ds, shuffle=True)
    # batch size 1 per GPU as in the paper's recipe; the global batch is `world`, so the
    # step budget is divided and Adam's lr gets the usual sqrt scaling
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)
    penalty_tf = transforms.Compose([transforms.Resize((2 * SIZE, 2 * SIZE)), transforms.RandomGrayscale(0.3),
                                     transforms.CenterCrop(SIZE), transforms.ToTensor(),
                                     transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    imagenet = datasets.ImageFolder(args.imagenet, transform=penalty_tf)
    penalty_loader = DataLoader(imagenet, batch_size=1, sampler=DistributedSampler(imagenet, shuffle=True),
                                num_workers=4, pin_memory=True)

    teacher = pdn_small(OUT_CH)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    # strided shard without padding, so every image counts exactly once in the channel statistics
    norm_shard = Subset(train_ds, range(rank, len(train_ds), world))
    t_mean, t_std = teacher_normalization(teacher, DataLoader(norm_shard, batch_size=8, num_workers=4), device)

    model = DDP(StudentAE().to(device), device_ids=[local_rank])
    total_steps = args.steps // world
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world ** 0.5, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=int(0.95 * total_steps), gamma=0.1)

    def infinite(loader, sampler_):
        for epoch in itertools.count():
            sampler_.set_epoch(epoch)
            yield from loader

    train_iter = infinite(loader, sampler)
    penalty_iter = infinite(penalty_loader, penalty_loader.sampler)
    t0 = time.time()
    for step in range(1, total_steps + 1):
        x_st, x_ae = [t.to(device, non_blocking=True) for t in next(train_iter)]
        x_pen = next(penalty_iter)[0].to(device, non_blocking=True)
        with torch.no_grad():
            t_st = (teacher(x_st) - t_mean) / t_std
            t_ae = (teacher(x_ae) - t_mean) / t_std

        s_st, ae_out, s_ae, s_pen = model(x_st, x_ae, x_pen)
        d_hard = (t_st - s_st[:, :OUT_CH]) ** 2
        d_q = torch.quantile(d_hard.flatten(), 0.999)
        loss_hard = d_hard[d_hard >= d_q].mean()
        loss_penalty = (s_pen[:, :OUT_CH] ** 2).mean()
        loss_ae = ((t_ae - ae_out) ** 2).mean()
        loss_stae = ((ae_out.detach() - s_ae[:, OUT_CH:]) ** 2).mean()
        loss = loss_hard + loss_penalty + loss_ae + loss_stae

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if step % 200 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step}/{total_steps} loss {l.item():.4f} ({(time.time() - t0) / step:.3f}s/step)")
        if step % args.ckpt_every == 0 or step == total_steps:
            torch.save({"student_ae": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "t_mean": t_mean, "t_std": t_std, "step": step}, out_dir / "train_state.pth")

    # ---- quantile normalisation on the validation images, then test AUROC (rank 0) ----
    if rank == 0:
        net = model.module.eval()
        val_maps_st, val_maps_ae = [], []
        for f in sorted((line_dir / "validation" / "good").glob("*.png")):
            st, ae = predict(default_tf(Image.open(f).convert("RGB"))[None].to(device), teacher, net, t_mean, t_std)
            val_maps_st.append(st.flatten())
            val_maps_ae.append(ae.flatten())
        st_all, ae_all = torch.cat(val_maps_st), torch.cat(val_maps_ae)
        q = {"a_st": torch.quantile(st_all, 0.9), "b_st": torch.quantile(st_all, 0.995),
             "a_ae": torch.quantile(ae_all, 0.9), "b_ae": torch.quantile(ae_all, 0.995)}
        labels, scores = [], []
        for d in sorted((line_dir / "test").iterdir()):
            for f in sorted(d.glob("*.png")):
                st, ae = predict(default_tf(Image.open(f).convert("RGB"))[None].to(device), teacher, net,
                                 t_mean, t_std, q)
                scores.append((0.5 * st + 0.5 * ae).max().item())
                labels.append(int(d.name != "good"))
        print(f"[{args.line}] test image AUROC {roc_auc_score(labels, scores):.4f} on {len(labels)} images")
        torch.save({"teacher": teacher.state_dict(), "student_ae": net.state_dict(), "t_mean": t_mean.cpu(),
                    "t_std": t_std.cpu(), "quantiles": {k: v.cpu() for k, v in q.items()}},
                   out_dir / "efficientad_final.pth")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
