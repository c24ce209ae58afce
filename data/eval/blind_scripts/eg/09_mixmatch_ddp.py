"""MixMatch (Berthelot et al., 2019) on CIFAR-10, DistributedDataParallel.

    torchrun --nproc_per_node=4 09_mixmatch_ddp.py --n-labeled 250 --out result/mixmatch_250
"""
import argparse
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import dataset.cifar10 as cifar10
import models.wideresnet as wrn

parser = argparse.ArgumentParser(description="MixMatch (DDP)")
parser.add_argument("--epochs", default=1024, type=int)
parser.add_argument("--start-epoch", default=0, type=int)
parser.add_argument("--batch-size", default=16, type=int, help="per GPU; 4 GPUs give the paper's 64")
parser.add_argument("--lr", default=0.002, type=float)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--manualSeed", type=int, default=0)
parser.add_argument("--n-labeled", type=int, default=250)
parser.add_argument("--train-iteration", type=int, default=1024)
parser.add_argument("--out", default="result")
parser.add_argument("--alpha", default=0.75, type=float)
parser.add_argument("--lambda-u", default=75, type=float)
parser.add_argument("--T", default=0.5, type=float)
parser.add_argument("--ema-decay", default=0.999, type=float)
parser.add_argument("--data", default="./data")
args = parser.parse_args()


class WeightEMA:
    """EMA of the weights, with the small weight decay step of the original implementation."""

    def __init__(self, model, ema_model, alpha=0.999):
        self.model, self.ema_model, self.alpha = model, ema_model, alpha
        self.params = list(model.state_dict().values())
        self.ema_params = list(ema_model.state_dict().values())
        self.wd = 0.02 * args.lr
        for p, ep in zip(self.params, self.ema_params):
            ep.data.copy_(p.data)

    def step(self):
        one_minus_alpha = 1.0 - self.alpha
        for p, ep in zip(self.params, self.ema_params):
            if ep.dtype == torch.float32:
                ep.mul_(self.alpha).add_(p * one_minus_alpha)
                p.mul_(1 - self.wd)


def linear_rampup(current, rampup_length):
    if rampup_length == 0:
        return 1.0
    return float(np.clip(current / rampup_length, 0.0, 1.0))


def sharpen(p, T):
    pt = p ** (1 / T)
    return pt / pt.sum(dim=1, keepdim=True)


def interleave_offsets(batch, nu):
    groups = [batch // (nu + 1)] * (nu + 1)
    for x in range(batch - sum(groups)):
        groups[-x - 1] += 1
    offsets = [0]
    for g in groups:
        offsets.append(offsets[-1] + g)
    return offsets


def interleave(xy, batch):
    nu = len(xy) - 1
    offsets = interleave_offsets(batch, nu)
    xy = [[v[offsets[p]:offsets[p + 1]] for p in range(nu + 1)] for v in xy]
    for i in range(1, nu + 1):
        xy[0][i], xy[i][i] = xy[i][i], xy[0][i]
    return [torch.cat(v, dim=0) for v in xy]


def train_one_epoch(labeled_iter, unlabeled_iter, model, optimizer, ema, epoch, device):
    model.train()
    losses, losses_x, losses_u = 0.0, 0.0, 0.0
    for batch_idx in range(args.train_iteration):
        try:
            inputs_x, targets_x = next(labeled_iter["it"])
        except StopIteration:
            labeled_iter["epoch"] += 1
            labeled_iter["sampler"].set_epoch(labeled_iter["epoch"])
            labeled_iter["it"] = iter(labeled_iter["loader"])
            inputs_x, targets_x = next(labeled_iter["it"])
        try:
            (inputs_u, inputs_u2), _ = next(unlabeled_iter["it"])
        except StopIteration:
            unlabeled_iter["epoch"] += 1
            unlabeled_iter["sampler"].set_epoch(unlabeled_iter["epoch"])
            unlabeled_iter["it"] = iter(unlabeled_iter["loader"])
            (inputs_u, inputs_u2), _ = next(unlabeled_iter["it"])

        bs = inputs_x.size(0)
        targets_x = F.one_hot(targets_x, 10).float().to(device, non_blocking=True)
        inputs_x = inputs_x.to(device, non_blocking=True)
        inputs_u, inputs_u2 = inputs_u.to(device, non_blocking=True), inputs_u2.to(device, non_blocking=True)

        with torch.no_grad():
            p = (torch.softmax(model(inputs_u), dim=1) + torch.softmax(model(inputs_u2), dim=1)) / 2
            targets_u = sharpen(p, args.T).detach()

        all_inputs = torch.cat([inputs_x, inputs_u, inputs_u2], dim=0)
        all_targets = torch.cat([targets_x, targets_u, targets_u], dim=0)
        lam = np.random.beta(args.alpha, args.alpha)
        lam = max(lam, 1 - lam)
        idx = torch.randperm(all_inputs.size(0), device=device)
        mixed_input = lam * all_inputs + (1 - lam) * all_inputs[idx]
        mixed_target = lam * all_targets + (1 - lam) * all_targets[idx]

        mixed_input = list(torch.split(mixed_input, bs))
        mixed_input = interleave(mixed_input, bs)
        logits = [model(mixed_input[0])]
        for inp in mixed_input[1:]:
            logits.append(model(inp))
        logits = interleave(logits, bs)
        logits_x, logits_u = logits[0], torch.cat(logits[1:], dim=0)

        Lx = -torch.mean(torch.sum(F.log_softmax(logits_x, dim=1) * mixed_target[:bs], dim=1))
        Lu = torch.mean((torch.softmax(logits_u, dim=1) - mixed_target[bs:]) ** 2)
        w = args.lambda_u * linear_rampup(epoch + batch_idx / args.train_iteration, 16)
        loss = Lx + w * Lu

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ema.step()

        losses += loss.item()
        losses_x += Lx.item()
        losses_u += Lu.item()
    n = args.train_iteration
    return losses / n, losses_x / n, losses_u / n


@torch.no_grad()
def validate(loader, model, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.numel()
    return loss_sum / total, 100.0 * correct / total


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    random.seed(args.manualSeed)
    np.random.seed(args.manualSeed)
    torch.manual_seed(args.manualSeed)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        cifar10.download(args.data)
    dist.barrier()
    train_labeled_set, train_unlabeled_set, val_set, test_set = cifar10.get_cifar10(
        args.data, args.n_labeled, transform_train=cifar10.train_transform(),
        transform_val=cifar10.val_transform(), seed=args.manualSeed)

    l_sampler = DistributedSampler(train_labeled_set, shuffle=True, drop_last=True)
    u_sampler = DistributedSampler(train_unlabeled_set, shuffle=True, drop_last=True)
    labeled_loader = DataLoader(train_labeled_set, batch_size=args.batch_size, sampler=l_sampler,
                                num_workers=4, drop_last=True, pin_memory=True)
    unlabeled_loader = DataLoader(train_unlabeled_set, batch_size=args.batch_size, sampler=u_sampler,
                                  num_workers=4, drop_last=True, pin_memory=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler, num_workers=4)

    model = wrn.WideResNet(num_classes=10).to(device)
    ema_model = wrn.WideResNet(num_classes=10).to(device)
    for p in ema_model.parameters():
        p.detach_()
    ema = WeightEMA(model, ema_model, alpha=args.ema_decay)
    # several forward passes per step (interleaved groups), so no buffer broadcast in forward
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_acc = 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        best_acc = ckpt["best_acc"]
        args.start_epoch = ckpt["epoch"]
        model.module.load_state_dict(ckpt["state_dict"])
        ema_model.load_state_dict(ckpt["ema_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])

    writer = SummaryWriter(args.out) if rank == 0 else None
    labeled_iter = {"loader": labeled_loader, "sampler": l_sampler, "epoch": 0, "it": iter(labeled_loader)}
    unlabeled_iter = {"loader": unlabeled_loader, "sampler": u_sampler, "epoch": 0, "it": iter(unlabeled_loader)}

    for epoch in range(args.start_epoch, args.epochs):
        t0 = time.time()
        train_loss, loss_x, loss_u = train_one_epoch(labeled_iter, unlabeled_iter, model, optimizer,
                                                     ema, epoch, device)
        test_loss, test_acc = validate(test_loader, ema_model, device)

        if rank == 0:
            writer.add_scalar("losses/train_loss", train_loss, epoch)
            writer.add_scalar("losses/test_loss", test_loss, epoch)
            writer.add_scalar("accuracy/test_acc", test_acc, epoch)
            is_best = test_acc > best_acc
            best_acc = max(test_acc, best_acc)
            ckpt_path = os.path.join(args.out, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "ema_state_dict": ema_model.state_dict(), "acc": test_acc,
                        "best_acc": best_acc, "optimizer": optimizer.state_dict()}, ckpt_path)
            if is_best:
                shutil.copyfile(ckpt_path, os.path.join(args.out, "model_best.pth.tar"))
            print(f"epoch {epoch}: loss {train_loss:.4f} (x {loss_x:.4f}, u {loss_u:.5f}) "
                  f"test acc {test_acc:.2f} best {best_acc:.2f} [{time.time() - t0:.0f}s]", flush=True)
        dist.barrier()

    if rank == 0:
        writer.close()
        print("Best acc:", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
