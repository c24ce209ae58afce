"""Soft self-paced reweighting for fine-tuning on Food-101 (noisy web labels).

After every epoch the whole training set is re-scored and each sample gets a
linear soft SPL weight  w_i = max(0, 1 - l_i / lambda_e),  with the age
parameter lambda_e set to a growing quantile of the current loss distribution.
The weighted loss is then used for the next epoch.

    torchrun --nproc_per_node=8 soft_spl_food101.py --data /datasets --epochs 30
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets")
    p.add_argument("--out", default="checkpoints/soft_spl_food101")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--q-start", type=float, default=0.6, help="loss quantile used as lambda at start")
    p.add_argument("--q-end", type=float, default=0.95)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Indexed(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


@torch.no_grad()
def score_losses(net, dataset, device, world):
    """Per-sample loss for the full training set, identical on every rank."""
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    idx_l, loss_l = [], []
    for x, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x.to(device, non_blocking=True))
        loss_l.append(F.cross_entropy(out.float(), y.to(device), reduction="none"))
        idx_l.append(idx.to(device))
    idx_t, loss_t = torch.cat(idx_l), torch.cat(loss_l)
    g_idx = [torch.empty_like(idx_t) for _ in range(world)]
    g_loss = [torch.empty_like(loss_t) for _ in range(world)]
    dist.all_gather(g_idx, idx_t)
    dist.all_gather(g_loss, loss_t)
    losses = torch.empty(len(dataset), device=device)
    losses[torch.cat(g_idx)] = torch.cat(g_loss)
    return losses


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x)
        s[0] += (out.argmax(1) == y).sum()
        s[1] += (out.topk(5, 1).indices == y[:, None]).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    if rank == 0:
        datasets.Food101(args.data, split="train", download=True)
        models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    train_set = Indexed(datasets.Food101(args.data, split="train", transform=train_tf))
    score_set = Indexed(datasets.Food101(args.data, split="train", transform=eval_tf))
    test_set = datasets.Food101(args.data, split="test", transform=eval_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.workers,
                             sampler=DistributedSampler(test_set, shuffle=False))

    net = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    net.fc = torch.nn.Linear(net.fc.in_features, 101)
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_loader))

    weights = torch.ones(len(train_set), device=device)
    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        weights = ck["weights"].to(device)
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        seen = torch.zeros(2, device=device)
        for x, y, idx in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            w = weights[idx.to(device)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            per_sample = F.cross_entropy(out.float(), y, reduction="none")
            loss = (w * per_sample).sum() / w.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            seen += torch.stack([(w > 0).sum().float(), torch.tensor(float(len(w)), device=device)])

        # re-score and update the self-paced weights for the next epoch
        if epoch + 1 >= args.warmup_epochs:
            losses = score_losses(net, score_set, device, world)
            q = args.q_start + (args.q_end - args.q_start) * epoch / max(args.epochs - 1, 1)
            lam = torch.quantile(losses.float(), q)
            weights = (1.0 - losses / lam).clamp_min(0.0)

        top1, top5 = evaluate(net, test_loader, device)
        dist.all_reduce(seen)
        if rank == 0:
            print(f"epoch {epoch} | used {seen[0] / seen[1]:.1%} of samples | "
                  f"top1 {top1:.4f} top5 {top5:.4f} | {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "weights": weights.cpu()}, ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
