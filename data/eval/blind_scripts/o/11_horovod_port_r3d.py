"""R3D-18 action recognition on UCF101 / HMDB51.

Originally a horovodrun script; ported to torch.distributed (torchrun) after the
cluster dropped the horovod module. Kept the hvd-style helpers so the rest of
the code did not have to change.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        11_horovod_port_r3d.py --root /datasets/ucf101 --split 1
"""
import argparse
import os
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ---- horovod compat -------------------------------------------------------------
class hvd:
    @staticmethod
    def init():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")

    @staticmethod
    def rank():
        return dist.get_rank()

    @staticmethod
    def size():
        return dist.get_world_size()

    @staticmethod
    def local_rank():
        return int(os.environ["LOCAL_RANK"])


def metric_average(val, name=None):
    t = torch.tensor(val, dtype=torch.float64, device="cuda")
    dist.all_reduce(t)
    return (t / hvd.size()).item()


# ---- data -----------------------------------------------------------------------
def ffmpeg_read(path, size=(128, 171)):
    h, w = size
    cmd = ["ffmpeg", "-loglevel", "error", "-i", path, "-vf", f"scale={w}:{h}", "-f", "rawvideo",
           "-pix_fmt", "rgb24", "pipe:"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True).stdout
    return np.frombuffer(out, np.uint8).reshape(-1, h, w, 3)


class UCF101(Dataset):
    def __init__(self, root, split, train, clip_len=16):
        lst = f"trainlist0{split}.txt" if train else f"testlist0{split}.txt"
        classes = {}
        with open(os.path.join(root, "ucfTrainTestlist", "classInd.txt")) as f:
            for line in f:
                i, name = line.split()
                classes[name] = int(i) - 1
        with open(os.path.join(root, "ucfTrainTestlist", lst)) as f:
            rels = [line.split()[0] for line in f if line.strip()]
        self.items = [(os.path.join(root, "UCF-101", r), classes[r.split("/")[0]]) for r in rels]
        self.train, self.clip_len = train, clip_len
        self.mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        v = ffmpeg_read(path)
        n = v.shape[0]
        if n < self.clip_len:
            v = np.concatenate([v, np.repeat(v[-1:], self.clip_len - n, 0)])
            n = self.clip_len
        s = np.random.randint(0, n - self.clip_len + 1) if self.train else (n - self.clip_len) // 2
        clip = torch.from_numpy(v[s:s + self.clip_len].copy()).permute(3, 0, 1, 2).float() / 255
        if self.train:
            y, x = np.random.randint(0, 128 - 112 + 1), np.random.randint(0, 171 - 112 + 1)
        else:
            y, x = 8, 29
        clip = clip[:, :, y:y + 112, x:x + 112]
        if self.train and np.random.rand() < 0.5:
            clip = clip.flip(-1)
        return (clip - self.mean) / self.std, label


# ---- train ----------------------------------------------------------------------
def train(epoch, model, loader, optimizer, args):
    model.train()
    losses, t0 = [], time.time()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data) * hvd.size()}/{len(loader.sampler) * hvd.size()}]"
                  f"\tLoss: {loss.item():.6f}\t{time.time() - t0:.1f}s", flush=True)
    return metric_average(float(np.mean(losses)), "train_loss")


def test(model, loader):
    model.eval()
    correct, count, loss_sum = 0.0, 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
            out = model(data)
            loss_sum += F.cross_entropy(out, target, reduction="sum").item()
            correct += (out.argmax(1) == target).sum().item()
            count += target.numel()
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device="cuda")
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/datasets/ucf101")
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.005, help="per worker, scaled by hvd.size()")
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--pretrained", action="store_true")
    parser.add_argument("--checkpoint-format", default="./checkpoints/r3d-{epoch}.pth.tar")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.backends.cudnn.benchmark = True

    train_dataset = UCF101(args.root, args.split, train=True)
    test_dataset = UCF101(args.root, args.split, train=False)
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_dataset, range(hvd.rank(), len(test_dataset), hvd.size())),
                             batch_size=args.batch_size, num_workers=4, pin_memory=True)

    weights = torchvision.models.video.R3D_18_Weights.KINETICS400_V1 if args.pretrained else None
    model = torchvision.models.video.r3d_18(weights=weights)
    model.fc = nn.Linear(512, 101)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[hvd.local_rank()])

    # horovod recipe: scale lr by number of workers, warm up for a few epochs
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9, weight_decay=5e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / hvd.size(), total_iters=5)
    decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 45], gamma=0.1)
    scheduler = torch.optim.lr_scheduler.ChainedScheduler([warmup, decay])

    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    if resume_from_epoch > 0:
        ckpt = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch),
                          map_location=f"cuda:{hvd.local_rank()}")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    for epoch in range(resume_from_epoch, args.epochs):
        train_loss = train(epoch, model, train_loader, optimizer, args)
        scheduler.step()
        test_loss, test_acc = test(model.module, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  acc {100 * test_acc:.2f}%",
                  flush=True)
            path = args.checkpoint_format.format(epoch=epoch + 1)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
