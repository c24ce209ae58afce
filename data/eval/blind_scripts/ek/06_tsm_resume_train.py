"""TSM ResNet-50 on Something-Something V2 with auto-resume (jobs are preempted every 24h).

torchrun --nproc_per_node=8 06_tsm_resume_train.py --config configs/tsm_r50_sthv2.yaml
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("num_segments", 8)
    cfg.setdefault("batch_size", 8)
    cfg.setdefault("epochs", 45)
    cfg.setdefault("lr", 0.01)
    cfg.setdefault("ref_batch", 64)
    cfg.setdefault("workers", 8)
    cfg["work_dir"] = args.work_dir or cfg.get("work_dir", "work_dirs/tsm_sthv2")
    return cfg


class Shift(nn.Module):
    def __init__(self, conv, n_segment, n_div=8):
        super().__init__()
        self.conv, self.n_segment, self.n_div = conv, n_segment, n_div

    def forward(self, x):
        nt, c, h, w = x.shape
        x = x.view(-1, self.n_segment, c, h, w)
        fold = c // self.n_div
        left = torch.cat([x[:, 1:, :fold], x.new_zeros(x.shape[0], 1, fold, h, w)], 1)
        right = torch.cat([x.new_zeros(x.shape[0], 1, fold, h, w), x[:, :-1, fold:2 * fold]], 1)
        x = torch.cat([left, right, x[:, :, 2 * fold:]], 2)
        return self.conv(x.view(nt, c, h, w))


def build_tsm(num_classes, num_segments):
    net = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
        for block in layer:
            block.conv1 = Shift(block.conv1, num_segments)
    net.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, num_classes))
    return net


class SthV2(Dataset):
    def __init__(self, root, ann, num_segments, train):
        self.root, self.num_segments, self.train = root, num_segments, train
        with open(ann) as f:
            self.items = [(l.split()[0], int(l.split()[1])) for l in f]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, f"{vid}.webm"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        ticks = np.linspace(0, n, self.num_segments + 1)
        if self.train:
            idx = [np.random.randint(int(a), max(int(a) + 1, int(b))) for a, b in zip(ticks[:-1], ticks[1:])]
        else:
            idx = ((ticks[:-1] + ticks[1:]) / 2).astype(int)
        x = torch.from_numpy(vr.get_batch(np.minimum(idx, n - 1)).asnumpy()).permute(0, 3, 1, 2).float() / 255
        x = F.interpolate(x, size=(256, int(256 * x.shape[-1] / x.shape[-2])), mode="bilinear")
        w = x.shape[-1]
        if self.train:
            top, left = np.random.randint(0, 33), np.random.randint(0, w - 223)
        else:
            top, left = 16, (w - 224) // 2
        x = x[..., top:top + 224, left:left + 224]
        x = (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        return x, label


def forward_clips(model, clips, num_segments):
    b = clips.shape[0]
    logits = model(clips.flatten(0, 1))
    return logits.view(b, num_segments, -1).mean(1)


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    hits = torch.zeros(3, device=device)
    for clips, y in loader:
        clips, y = clips.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = forward_clips(model, clips, cfg["num_segments"])
        top5 = out.topk(5, 1).indices
        hits += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                             torch.tensor(len(y), device=device)]).float()
    dist.all_reduce(hits)
    return 100 * hits[0].item() / hits[2].item(), 100 * hits[1].item() / hits[2].item()


def latest_checkpoint(work_dir):
    ckpts = sorted(glob.glob(os.path.join(work_dir, "epoch_*.pth")),
                   key=lambda p: int(os.path.basename(p)[6:-4]))
    return ckpts[-1] if ckpts else None


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    model = build_tsm(cfg["num_classes"], cfg["num_segments"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    lr = cfg["lr"] * cfg["batch_size"] * world / cfg["ref_batch"]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 40], gamma=0.1)

    start_epoch, best = 0, 0.0
    resume = latest_checkpoint(cfg["work_dir"])
    if resume is not None:
        ckpt = torch.load(resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"], ckpt["best"]
        if rank == 0:
            print(f"resumed from {resume} (epoch {start_epoch})")

    model = DDP(model, device_ids=[local_rank])

    train_set = SthV2(cfg["video_root"], cfg["train_ann"], cfg["num_segments"], train=True)
    val_set = SthV2(cfg["video_root"], cfg["val_ann"], cfg["num_segments"], train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.get("seed", 0))
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    shard = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(shard, batch_size=cfg["batch_size"], num_workers=cfg["workers"], pin_memory=True)
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(os.path.join(cfg["work_dir"], "tf_logs")) if rank == 0 else None

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (clips, y) in enumerate(train_loader):
            clips, y = clips.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(forward_clips(model, clips, cfg["num_segments"]), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + it)
                print(f"[{epoch}/{cfg['epochs']}][{it}/{len(train_loader)}] loss={loss.item():.3f} "
                      f"t={time.time() - t0:.0f}s", flush=True)
        scheduler.step()

        top1, top5 = evaluate(model.module, val_loader, cfg, device)
        if rank == 0:
            best = max(best, top1)
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} best {best:.2f}")
            os.makedirs(cfg["work_dir"], exist_ok=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best},
                       os.path.join(cfg["work_dir"], f"epoch_{epoch + 1}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
