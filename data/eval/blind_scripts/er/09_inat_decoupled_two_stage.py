"""Two-stage decoupled training on iNaturalist 2018 (Kang et al., 2020).

stage "joint": representation learning, instance-balanced sampling, 200 epochs
stage "crt":   classifier re-training on frozen features, class-balanced sampling

    torchrun --nproc_per_node=8 inat_decoupled_two_stage.py --stage joint --out exp/inat_r50
    torchrun --nproc_per_node=8 inat_decoupled_two_stage.py --stage crt --out exp/inat_r50 \
        --init exp/inat_r50/joint_final.pth
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


class INat(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"{split}2018.json")) as f:
            js = json.load(f)
        lab = {a["image_id"]: a["category_id"] for a in js["annotations"]}
        self.paths = [os.path.join(root, im["file_name"]) for im in js["images"]]
        self.targets = np.array([lab[im["id"]] for im in js["images"]], dtype=np.int64)
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                          transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                          transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), int(self.targets[i])


class ClassBalancedIndex(Dataset):
    """Re-indexes a dataset so that a plain DistributedSampler yields class-balanced batches.

    Each epoch ("resample") draws len(base) indices: a uniform class, then a uniform
    image of that class. The draw is seeded by epoch so all ranks build the same list.
    """

    def __init__(self, base, seed=0):
        self.base, self.seed = base, seed
        self.by_class = [np.flatnonzero(base.targets == c) for c in range(base.targets.max() + 1)]
        self.resample(0)

    def resample(self, epoch):
        rng = np.random.default_rng(self.seed + epoch)
        cls = rng.integers(len(self.by_class), size=len(self.base))
        self.index = np.array([rng.choice(self.by_class[c]) for c in cls])

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        return self.base[int(self.index[i])]


def build_model(num_classes):
    return models.resnet50(num_classes=num_classes)


@torch.no_grad()
def evaluate(model, dataset, train_targets, rank, world, device, bs=256):
    model.eval()
    part = torch.utils.data.Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(part, batch_size=bs, num_workers=8, pin_memory=True)
    C = int(train_targets.max()) + 1
    acc = torch.zeros(2, C, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = model(x).argmax(1)
        acc[0] += torch.bincount(y, weights=(p == y).float(), minlength=C)
        acc[1] += torch.bincount(y, minlength=C).float()
    dist.all_reduce(acc)
    per_cls = (acc[0] / acc[1].clamp(min=1)).cpu().numpy()
    n = np.bincount(train_targets, minlength=C)
    return dict(overall=float(acc[0].sum() / acc[1].sum()), many=per_cls[n > 100].mean(),
                medium=per_cls[(n >= 20) & (n <= 100)].mean(), few=per_cls[n < 20].mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/inat2018")
    ap.add_argument("--stage", choices=["joint", "crt"], required=True)
    ap.add_argument("--init", default=None, help="stage-1 checkpoint for --stage crt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.2, help="for a total batch of 512")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    epochs = args.epochs or (200 if args.stage == "joint" else 30)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_base = INat(args.root, "train", train=True)
    val_set = INat(args.root, "val", train=False)
    num_classes = int(train_base.targets.max()) + 1

    model = build_model(num_classes)
    if args.stage == "crt":
        state = torch.load(args.init, map_location="cpu")
        model.load_state_dict(state["model"])
        for n, p in model.named_parameters():
            p.requires_grad = n.startswith("fc.")
        model.fc.reset_parameters()
        train_set = ClassBalancedIndex(train_base, seed=args.seed)
    else:
        train_set = train_base
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True)
    lr = args.lr * args.batch_size * world / 512
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(epochs):
        if args.stage == "crt":
            train_set.resample(epoch)
        sampler.set_epoch(epoch)
        model.train()
        if args.stage == "crt":
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        tot, n = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot, n = tot + loss.item(), n + 1
        sched.step()

        if epoch % 10 == 9 or epoch == epochs - 1:
            r = evaluate(model.module, val_set, train_base.targets, rank, world, device)
            if rank == 0:
                print(f"[{args.stage}] ep {epoch} loss {tot / max(n, 1):.3f} overall {100 * r['overall']:.2f} "
                      f"many {100 * r['many']:.2f} med {100 * r['medium']:.2f} few {100 * r['few']:.2f}",
                      flush=True)
        if rank == 0:
            torch.save({"model": model.state_dict(), "epoch": epoch, "stage": args.stage},
                       os.path.join(args.out, f"{args.stage}_final.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
