"""ACVNet training (SceneFlow pretraining -> KITTI finetuning), resumable, DistributedDataParallel.

    torchrun --nproc_per_node=4 train_acv.py --dataset sceneflow --datapath /data/SceneFlow \
        --trainlist filenames/sceneflow_train.txt --testlist filenames/sceneflow_test.txt \
        --epochs 64 --lrepochs "20,32,40,48,56:2" --logdir runs/acv_sf --resume
"""
import argparse
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from datasets import __datasets__
from models import ACVNet

parser = argparse.ArgumentParser(description="Attention Concatenation Volume for Accurate and Efficient Stereo Matching")
parser.add_argument("--maxdisp", type=int, default=192)
parser.add_argument("--dataset", required=True, choices=list(__datasets__.keys()))
parser.add_argument("--datapath", required=True)
parser.add_argument("--trainlist", required=True)
parser.add_argument("--testlist", required=True)
parser.add_argument("--lr", type=float, default=0.001)
parser.add_argument("--batch_size", type=int, default=4, help="per GPU")
parser.add_argument("--test_batch_size", type=int, default=4)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--lrepochs", default="20,32,40,48,56:2")
parser.add_argument("--attention_weights_only", action="store_true")
parser.add_argument("--freeze_attention_weights", action="store_true")
parser.add_argument("--logdir", required=True)
parser.add_argument("--loadckpt", default=None, help="init weights (e.g. SceneFlow model for KITTI)")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--save_freq", type=int, default=1)
parser.add_argument("--seed", type=int, default=1)


def adjust_learning_rate(optimizer, epoch, base_lr, lrepochs):
    epochs, rate = lrepochs.split(":")
    lr = base_lr
    for e in (int(x) for x in epochs.split(",")):
        if epoch >= e:
            lr /= float(rate)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def model_loss_train(disp_ests, disp_gt, mask, attention_only=False):
    weights = [1.0] if attention_only else [0.5, 0.5, 0.7, 1.0]
    return sum(w * F.smooth_l1_loss(d[mask], disp_gt[mask], reduction="mean") for d, w in zip(disp_ests, weights))


def latest_checkpoint(logdir):
    ckpts = [f for f in os.listdir(logdir) if re.match(r"checkpoint_\d+\.ckpt$", f)]
    if not ckpts:
        return None
    ckpts.sort(key=lambda f: int(re.findall(r"\d+", f)[0]))
    return os.path.join(logdir, ckpts[-1])


def save_checkpoint(model, optimizer, epoch, logdir):
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    path = os.path.join(logdir, "checkpoint_{:06d}.ckpt".format(epoch))
    torch.save(state, path)
    return path


@torch.no_grad()
def test_epoch(model, loader, maxdisp, device):
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # epe, d1, >3px, count
    for sample in loader:
        imgL, imgR = sample["left"].to(device), sample["right"].to(device)
        disp_gt = sample["disparity"].to(device)
        mask = (disp_gt < maxdisp) & (disp_gt > 0)
        disp_est = model(imgL, imgR)[-1]
        err = (disp_est[mask] - disp_gt[mask]).abs()
        sums[0] += err.sum().double()
        sums[1] += ((err > 3) & (err > 0.05 * disp_gt[mask].abs())).sum().double()
        sums[2] += (err > 3).sum().double()
        sums[3] += mask.sum().double()
    dist.all_reduce(sums)
    model.train()
    n = sums[3].item()
    return {"EPE": sums[0].item() / n, "D1": sums[1].item() / n, "Thres3": sums[2].item() / n}


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
    dist.barrier()
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    StereoDataset = __datasets__[args.dataset]
    train_set = StereoDataset(args.datapath, args.trainlist, True)
    test_set = StereoDataset(args.datapath, args.testlist, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), args.test_batch_size,
                             shuffle=False, num_workers=4, pin_memory=True)

    net = ACVNet(args.maxdisp, args.attention_weights_only, args.freeze_attention_weights)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, net.parameters()), lr=args.lr,
                                 betas=(0.9, 0.999))

    start_epoch = 0
    resume_path = latest_checkpoint(args.logdir) if args.resume else None
    if resume_path is not None:
        state = torch.load(resume_path, map_location="cpu")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print("resuming from", resume_path)
    elif args.loadckpt:
        state = torch.load(args.loadckpt, map_location="cpu")
        net.load_state_dict({k.replace("module.", "", 1): v for k, v in state["model"].items()}, strict=False)
        if rank == 0:
            print("initialised from", args.loadckpt)

    net.to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        lr = adjust_learning_rate(optimizer, epoch, args.lr, args.lrepochs)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for batch_idx, sample in enumerate(train_loader):
            imgL = sample["left"].to(device, non_blocking=True)
            imgR = sample["right"].to(device, non_blocking=True)
            disp_gt = sample["disparity"].to(device, non_blocking=True)
            mask = (disp_gt < args.maxdisp) & (disp_gt > 0)
            optimizer.zero_grad()
            disp_ests = model(imgL, imgR)
            loss = model_loss_train(disp_ests, disp_gt, mask, args.attention_weights_only)
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(agg)
        if rank == 0:
            avg = (agg[0] / agg[1]).item()
            writer.add_scalar("train/loss", avg, epoch)
            writer.add_scalar("train/lr", lr, epoch)
            print("epoch {}/{} train loss {:.3f} ({:.0f}s)".format(epoch, args.epochs, avg, time.time() - t0))
            if (epoch + 1) % args.save_freq == 0:
                save_checkpoint(model, optimizer, epoch, args.logdir)

        metrics = test_epoch(model.module, test_loader, args.maxdisp, device)
        if rank == 0:
            for k, v in metrics.items():
                writer.add_scalar("test/" + k, v, epoch)
            print("epoch {} test {}".format(epoch, metrics))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
