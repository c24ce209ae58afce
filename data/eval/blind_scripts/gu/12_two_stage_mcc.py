"""Two-stage adaptation on DomainNet-126: source-only pretraining, then MCC.

Stage 1 (--stage source) trains ResNet-50 on the labelled source domain.
Stage 2 (--stage adapt) starts from the stage-1 weights and adds the Minimum Class
Confusion loss (Jin et al., ECCV'20) on unlabelled target batches.

    torchrun --nproc_per_node=4 12_two_stage_mcc.py --stage source --source real --target sketch
    torchrun --nproc_per_node=4 12_two_stage_mcc.py --stage adapt  --source real --target sketch
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

NUM_CLASSES = 126


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["source", "adapt"], required=True)
    p.add_argument("--root", default="/datasets/domainnet126")
    p.add_argument("--source", default="real")
    p.add_argument("--target", default="sketch")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--temperature", type=float, default=2.5)
    p.add_argument("--mcc-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--work-dir", default="work/mcc_dn126")
    return p.parse_args()


class ListDataset(Dataset):
    def __init__(self, root, domain, split, transform):
        with open(os.path.join(root, f"{domain}_list_{split}.txt")) as f:
            self.items = [(os.path.join(root, a), int(b)) for a, b in (l.split() for l in f)]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), y


TRAIN_TF = transforms.Compose([
    transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), transforms.RandomHorizontalFlip(),
    transforms.ColorJitter(0.3, 0.3, 0.3), transforms.ToTensor(),
    transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
])
TEST_TF = transforms.Compose([
    transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
    transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
])


def make_loader(ds, batch_size, workers, train):
    sampler = DistributedSampler(ds, shuffle=train, drop_last=train)
    return DataLoader(ds, batch_size, sampler=sampler, num_workers=workers, pin_memory=True,
                      drop_last=train), sampler


def build_model():
    m = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
    m.fc = nn.Linear(2048, NUM_CLASSES)
    return m


def mcc_loss(logits, T):
    n, c = logits.shape
    prob = F.softmax(logits / T, dim=1)
    ent = -(prob * torch.log(prob + 1e-5)).sum(1)
    w = 1 + torch.exp(-ent)
    w = (n * w / w.sum()).unsqueeze(1)
    cov = (prob * w).t().mm(prob)
    cov = cov / cov.sum(1, keepdim=True)
    return (cov.sum() - cov.trace()) / c


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += len(y)
    dist.all_reduce(t)
    model.train()
    return 100 * (t[0] / t[1]).item()


def set_lr(optimizer, base_lrs, progress):
    for g, lr in zip(optimizer.param_groups, base_lrs):
        g["lr"] = lr * (1 + 10 * progress) ** -0.75


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    stage_dir = os.path.join(args.work_dir, f"{args.source}2{args.target}")
    src_ckpt = os.path.join(stage_dir, "source_only.pth")
    if rank == 0:
        os.makedirs(stage_dir, exist_ok=True)

    src_train = ListDataset(args.root, args.source, "train", TRAIN_TF)
    tgt_train = ListDataset(args.root, args.target, "train", TRAIN_TF)
    tgt_test = ListDataset(args.root, args.target, "test", TEST_TF)
    s_loader, s_sampler = make_loader(src_train, args.batch_size, args.workers, True)
    t_loader, t_sampler = make_loader(tgt_train, args.batch_size, args.workers, True)
    test_loader, _ = make_loader(tgt_test, 128, args.workers, False)

    net = build_model()
    if args.stage == "adapt":
        state = torch.load(src_ckpt, map_location="cpu")
        net.load_state_dict(state["model"])
    net = net.to(device)
    params = [{"params": [p for n, p in net.named_parameters() if not n.startswith("fc.")], "lr": 0.1 * args.lr},
              {"params": net.fc.parameters(), "lr": args.lr}]
    base_lrs = [g["lr"] for g in params]
    optimizer = torch.optim.SGD(params, momentum=0.9, weight_decay=1e-3, nesterov=True)
    model = DDP(net, device_ids=[local_rank])

    epochs = args.epochs or (10 if args.stage == "source" else 20)
    steps = min(len(s_loader), len(t_loader)) if args.stage == "adapt" else len(s_loader)
    total = epochs * steps
    best = 0.0
    for epoch in range(epochs):
        s_sampler.set_epoch(epoch)
        t_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        if args.stage == "source":
            batches = ((xs, ys, None) for xs, ys in s_loader)
        else:
            batches = ((xs, ys, xt) for (xs, ys), (xt, _) in zip(s_loader, t_loader))
        for i, (xs, ys, xt) in enumerate(batches):
            set_lr(optimizer, base_lrs, (epoch * steps + i) / total)
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            if xt is None:
                loss = F.cross_entropy(model(xs), ys, label_smoothing=0.1)
                aux = torch.zeros((), device=device)
            else:
                xt = xt.to(device, non_blocking=True)
                out = model(torch.cat([xs, xt]))
                cls = F.cross_entropy(out[: len(xs)], ys)
                aux = mcc_loss(out[len(xs):], args.temperature)
                loss = cls + args.mcc_weight * aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % 200 == 0:
                v = torch.stack([loss.detach(), aux.detach()])
                dist.all_reduce(v, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{args.stage}] ep {epoch} {i}/{steps} loss {v[0]:.4f} mcc {v[1]:.4f} "
                          f"{time.time() - tic:.0f}s", flush=True)

        acc = test(model, test_loader, device)
        if rank == 0:
            print(f"[{args.stage}] epoch {epoch}: {args.target} acc {acc:.2f}", flush=True)
            if args.stage == "source":
                torch.save({"model": model.state_dict(), "epoch": epoch, "acc": acc}, src_ckpt)
            elif acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(stage_dir, "mcc_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
