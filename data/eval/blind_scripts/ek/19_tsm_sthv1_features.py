"""TSM-R50 on Something-Something V1, with an optional feature-dump mode for the
temporal-localization students (pooled 2048-d features per segment).

    train: torchrun --nproc_per_node=8 19_tsm_sthv1_features.py --root /data/sthv1 --work-dir exp/tsm_sthv1
    dump : torchrun --nproc_per_node=8 19_tsm_sthv1_features.py --root /data/sthv1 --work-dir exp/tsm_sthv1 \
               --dump-features --weights exp/tsm_sthv1/best.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--num-classes", type=int, default=174)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01, help="for 64 clips")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--dump-features", action="store_true")
    p.add_argument("--weights", default="")
    return p.parse_args()


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, n_div=8):
        super().__init__()
        self.net, self.n_segment, self.fold_div = net, n_segment, n_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSN(nn.Module):
    def __init__(self, num_class, num_segments, dropout=0.5):
        super().__init__()
        self.num_segments = num_segments
        self.base_model = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        for layer in (self.base_model.layer1, self.base_model.layer2, self.base_model.layer3, self.base_model.layer4):
            for blk in layer:
                blk.conv1 = TemporalShift(blk.conv1, num_segments)
        feature_dim = self.base_model.fc.in_features
        self.dropout = nn.Dropout(p=dropout)
        self.new_fc = nn.Linear(feature_dim, num_class)
        nn.init.normal_(self.new_fc.weight, 0, 0.001)
        nn.init.constant_(self.new_fc.bias, 0)

    def features(self, x):
        m = self.base_model
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        x = m.layer4(m.layer3(m.layer2(m.layer1(x))))
        return torch.flatten(m.avgpool(x), 1)

    def forward(self, x, return_features=False):
        b = x.shape[0]
        feat = self.features(x.flatten(0, 1))
        if return_features:
            return feat.view(b, self.num_segments, -1)
        out = self.new_fc(self.dropout(feat))
        return out.view(b, self.num_segments, -1).mean(dim=1)


class SthV1(Dataset):
    def __init__(self, root, split, segments, train):
        self.root, self.segments, self.train = root, segments, train
        with open(os.path.join(root, f"{split}_videofolder.txt")) as f:
            self.items = [(l.split()[0], int(l.split()[-1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, label = self.items[i]
        vr = VideoReader(os.path.join(self.root, "videos", f"{vid}.mp4"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        tick = n / self.segments
        if self.train:
            idx = (np.arange(self.segments) * tick + np.random.rand(self.segments) * tick).astype(int)
        else:
            idx = (np.arange(self.segments) * tick + tick / 2).astype(int)
        x = torch.from_numpy(vr.get_batch(np.minimum(idx, n - 1)).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        x = F.interpolate(x, size=(240, 320), mode="bilinear", align_corners=False)
        if self.train:
            crop = int(np.random.choice([240, 210, 180, 160]))
            t, l = np.random.randint(0, 241 - crop), np.random.randint(0, 321 - crop)
            x = F.interpolate(x[..., t:t + crop, l:l + crop], size=(224, 224), mode="bilinear", align_corners=False)
        else:
            x = x[..., 8:232, 48:272]
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        return (x - mean) / std, label, i


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            top5 = model(x).topk(5, 1).indices
        acc[0] += (top5[:, 0] == y).sum()
        acc[1] += (top5 == y[:, None]).any(1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[2]).item(), (100 * acc[1] / acc[2]).item()


@torch.no_grad()
def dump_features(model, dataset, rank, world, device, out_dir):
    model.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=16, num_workers=8)
    os.makedirs(out_dir, exist_ok=True)
    for x, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats = model(x.to(device), return_features=True).float().cpu().numpy()
        for f, j in zip(feats, idx.tolist()):
            np.save(os.path.join(out_dir, f"{dataset.items[j][0]}.npy"), f)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = TSN(args.num_classes, args.segments)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    val_set = SthV1(args.root, "val", args.segments, False)

    if args.dump_features:
        model.load_state_dict(torch.load(args.weights, map_location="cpu")["state_dict"])
        dump_features(model, val_set, rank, world, device, os.path.join(args.work_dir, "features"))
        dist.barrier()
        dist.destroy_process_group()
        return

    model = DDP(model, device_ids=[local_rank])
    train_set = SthV1(args.root, "train", args.segments, True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 64
    fc_ids = {id(p) for p in model.module.new_fc.parameters()}
    optimizer = torch.optim.SGD(
        [{"params": [p for p in model.parameters() if id(p) not in fc_ids], "lr": lr},
         {"params": list(model.module.new_fc.parameters()), "lr": lr * 5}],
        momentum=0.9, weight_decay=5e-4)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        decay = 0.1 ** sum(epoch >= m for m in (20, 40))
        for g, b in zip(optimizer.param_groups, base_lrs):
            g["lr"] = b * decay
        model.train()
        t0 = time.time()
        for it, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)
        top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            state = {"epoch": epoch, "state_dict": model.module.state_dict(), "top1": top1}
            torch.save(state, os.path.join(args.work_dir, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.work_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
