# DVS128 Gesture, spikingjelly multi-step LIF VGG with tdBN-style BatchNorm.
#
#   torchrun --nproc_per_node=4 03_sj_gesture_syncbn_amp.py \
#       --root /data/DVS128Gesture --T 16 --global-batch 64 --amp
#
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class WithIndex(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return i, torch.as_tensor(x, dtype=torch.float32), y


class SpikingVGG(nn.Module):
    def __init__(self, channels=128, num_classes=11, tau=2.0):
        super().__init__()
        blocks = []
        c_in = 2
        for _ in range(5):
            blocks += [
                # conv + BN applied on the flattened [T*N] batch
                layer.SeqToANNContainer(nn.Conv2d(c_in, channels, 3, padding=1, bias=False),
                                        nn.BatchNorm2d(channels)),
                neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan(), detach_reset=True),
                layer.SeqToANNContainer(nn.MaxPool2d(2, 2)),
            ]
            c_in = channels
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(
            layer.Flatten(),
            layer.Dropout(0.5),
            layer.SeqToANNContainer(nn.Linear(channels * 4 * 4, 512)),
            neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.Dropout(0.5),
            layer.SeqToANNContainer(nn.Linear(512, num_classes * 10)),
            neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.VotingLayer(10),
        )
        functional.set_step_mode(self, "m")

    def forward(self, x):  # x: [N, T, 2, H, W]
        x = x.transpose(0, 1).contiguous()
        out = self.classifier(self.features(x))  # [T, N, classes]
        return out.mean(0)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--T", type=int, default=16)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="for the global batch")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="logs/sj_gesture")
    p.add_argument("--resume", default="")
    return p.parse_args()


def evaluate(model, loader, device, amp, rank, n_samples):
    model.eval()
    records = []
    with torch.no_grad():
        for idx, x, y in loader:
            x = x.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=amp):
                fr = model(x)
            functional.reset_net(model)
            pred = fr.argmax(1).cpu()
            records += list(zip(idx.tolist(), pred.tolist(), y.tolist()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if rank != 0:
        return None
    # DistributedSampler pads the last shard with repeats; keep one entry per sample
    per_sample = {}
    for part in gathered:
        for i, p, t in part:
            per_sample[i] = (p == t)
    assert len(per_sample) == n_samples
    return sum(per_sample.values()) / n_samples


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0, "global batch must divide by world size"
    per_gpu = args.global_batch // world

    # first use integrates the raw events into frames_number_T_split_by_number/;
    # rank 0 does it, the others load the finished folder afterwards
    def make_sets():
        tr = DVS128Gesture(args.root, train=True, data_type="frame", frames_number=args.T, split_by="number")
        te = DVS128Gesture(args.root, train=False, data_type="frame", frames_number=args.T, split_by="number")
        return WithIndex(tr), WithIndex(te)

    if rank == 0:
        train_set, test_set = make_sets()
    dist.barrier()
    if rank != 0:
        train_set, test_set = make_sets()

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=2023)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=per_gpu, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    net = SpikingVGG().to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DistributedDataParallel(net, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "checkpoint_latest.pth")
    resume = args.resume or (ckpt_path if os.path.exists(ckpt_path) else "")
    if resume:
        ck = torch.load(resume, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ck["net"])
        optimizer.load_state_dict(ck["optimizer"])
        lr_sched.load_state_dict(ck["lr_scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["max_test_acc"]

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out, purge_step=start_epoch)

    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(3, device=device)  # loss*n, correct, n
        for _, x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            y_onehot = F.one_hot(y, 11).float()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                fr = model(x)
                loss = F.mse_loss(fr, y_onehot)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            functional.reset_net(model)
            tot += torch.stack([loss.detach() * y.numel(), (fr.argmax(1) == y).sum().float(),
                                torch.tensor(float(y.numel()), device=device)])
        lr_sched.step()
        dist.all_reduce(tot)
        train_loss, train_acc = (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()

        test_acc = evaluate(model, test_loader, device, args.amp, rank, len(test_set))

        if rank == 0:
            best = max(best, test_acc)
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/acc", train_acc, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            ck = {"net": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "lr_scheduler": lr_sched.state_dict(), "scaler": scaler.state_dict(),
                  "epoch": epoch, "max_test_acc": best}
            torch.save(ck, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if test_acc >= best:
                torch.save(ck, os.path.join(args.out, "checkpoint_max.pth"))
            print(f"epoch {epoch} train_loss {train_loss:.4f} train_acc {train_acc:.4f} "
                  f"test_acc {test_acc:.4f} best {best:.4f} ({time.time() - t0:.1f}s)", flush=True)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
