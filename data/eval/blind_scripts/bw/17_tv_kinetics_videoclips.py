"""R(2+1)D-18 on Kinetics-400 using torchvision.datasets.Kinetics / VideoClips.

Building the VideoClips metadata (timestamps of every frame of ~240k videos) takes
hours, so it is cached in --cache-dir and reused by later runs.

    torchrun --nproc_per_node=8 17_tv_kinetics_videoclips.py --data-path /data/kinetics400 \
        --cache-dir /data/kinetics400/.cache --output-dir /exp/r2p1d_tv
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate
from torchvision.datasets.samplers import DistributedSampler, RandomClipSampler, UniformClipSampler
from torchvision.models.video import r2plus1d_18


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--clip-len", type=int, default=16)
    p.add_argument("--frame-rate", type=int, default=15)
    p.add_argument("--clips-per-video", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--epochs", type=int, default=45)
    p.add_argument("--lr", type=float, default=0.64, help="for a global batch of 1024")
    p.add_argument("--lr-warmup-epochs", type=int, default=10)
    p.add_argument("--lr-milestones", type=int, nargs="+", default=[20, 30, 40])
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--metadata-workers", type=int, default=16)
    return p.parse_args()


class VideoTransform:
    mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
    std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __init__(self, train):
        self.train = train

    def __call__(self, vid):  # vid: (T, C, H, W) uint8
        x = F.interpolate(vid.float() / 255.0, size=(128, 171), mode="bilinear", align_corners=False)
        if self.train:
            i = int(torch.randint(0, 128 - 112 + 1, (1,)))
            j = int(torch.randint(0, 171 - 112 + 1, (1,)))
            x = x[..., i:i + 112, j:j + 112]
            if torch.rand(1) < 0.5:
                x = x.flip(-1)
        else:
            x = x[..., 8:120, 29:141]
        return (x.transpose(0, 1) - self.mean) / self.std


def collate_fn(batch):
    # drop the audio
    return default_collate([(video, label) for video, _, label in batch])


def load_kinetics(args, split, transform):
    cache_path = os.path.join(args.cache_dir, f"k400_{split}_{args.clip_len}f_{args.frame_rate}fps.pt")
    kwargs = dict(frames_per_clip=args.clip_len, num_classes="400", split=split, frame_rate=args.frame_rate,
                  step_between_clips=1, transform=transform, extensions=("mp4",), output_format="TCHW")
    if os.path.exists(cache_path):
        print(f"loading cached {split} metadata from {cache_path}", flush=True)
        metadata = torch.load(cache_path, weights_only=False)
        dataset = torchvision.datasets.Kinetics(args.data_path, _precomputed_metadata=metadata, **kwargs)
    else:
        print(f"computing {split} metadata (this is slow)", flush=True)
        dataset = torchvision.datasets.Kinetics(args.data_path, num_workers=args.metadata_workers, **kwargs)
        os.makedirs(args.cache_dir, exist_ok=True)
        torch.save(dataset.metadata, cache_path)
    return dataset


class ListSampler(torch.utils.data.Sampler):
    def __init__(self, indices):
        self.indices = list(indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for video, target in loader:
        video, target = video.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(video)
        top5 = out.topk(5, 1).indices
        t[0] += (top5[:, 0] == target).sum()
        t[1] += (top5 == target[:, None]).any(1).sum()
        t[2] += target.numel()
    dist.all_reduce(t)
    return (100 * t[0] / t[2]).item(), (100 * t[1] / t[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # same seed on every rank: RandomClipSampler draws its permutation from the global RNG
    torch.manual_seed(0)

    dataset = load_kinetics(args, "train", VideoTransform(train=True))
    dataset_test = load_kinetics(args, "val", VideoTransform(train=False))

    train_sampler = DistributedSampler(RandomClipSampler(dataset.video_clips, args.clips_per_video))
    # evaluation: 10 uniformly spaced clips per video, split across ranks without padding
    test_clips = list(UniformClipSampler(dataset_test.video_clips, 10))
    test_sampler = ListSampler(test_clips[rank::world])
    data_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                             pin_memory=True, collate_fn=collate_fn, drop_last=True)
    data_loader_test = DataLoader(dataset_test, batch_size=args.batch_size, sampler=test_sampler,
                                  num_workers=args.workers, pin_memory=True, collate_fn=collate_fn)

    model = r2plus1d_18(num_classes=400)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 1024
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(data_loader)
    warmup_iters = args.lr_warmup_epochs * iters
    milestones = [iters * (m - args.lr_warmup_epochs) for m in args.lr_milestones]
    main_sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    warm_sched = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.001, total_iters=warmup_iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm_sched, main_sched], milestones=[warmup_iters])
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    start = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (video, target) in enumerate(data_loader):
            video, target = video.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(video), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{iters}] loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}",
                      flush=True)
        acc1, acc5 = evaluate(model.module, data_loader_test, device)
        if rank == 0:
            print(f"epoch {epoch}: clip acc@1 {acc1:.2f} acc@5 {acc5:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint.pth"))

    if rank == 0:
        print("training time", str(datetime.timedelta(seconds=int(time.time() - start))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
