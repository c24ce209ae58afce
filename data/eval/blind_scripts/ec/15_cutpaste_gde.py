"""CutPaste self-supervised anomaly detection (3-way: normal / cutpaste / scar).

A ResNet18 learns to tell normal images from CutPaste and CutPaste-Scar
augmented ones. At test time a Gaussian density estimator (GDE) is fitted on
the embeddings of the nominal training images and the Mahalanobis distance
is the anomaly score.

    torchrun --nproc_per_node=4 15_cutpaste_gde.py --data /mnt/mvtec --category hazelnut \
        --out /mnt/exp/cutpaste
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.covariance import LedoitWolf
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import resnet18, ResNet18_Weights

logger = logging.getLogger("cutpaste")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--category", required=True)
    parser.add_argument("--out", default="./cutpaste_runs")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU, before augmentation (x3)")
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class CutPaste3Way:
    def __init__(self, area=(0.02, 0.15), aspect=0.3, scar_w=(2, 16), scar_h=(10, 25)):
        self.area, self.aspect, self.scar_w, self.scar_h = area, aspect, scar_w, scar_h
        self.jitter = transforms.ColorJitter(0.1, 0.1, 0.1, 0.1)

    def _cutpaste(self, img):
        w, h = img.size
        a = random.uniform(*self.area) * w * h
        log_r = (math.log(self.aspect), math.log(1 / self.aspect))
        r = math.exp(random.uniform(*log_r))
        cw, ch = int(math.sqrt(a * r)), int(math.sqrt(a / r))
        x, y = random.randint(0, w - cw), random.randint(0, h - ch)
        patch = self.jitter(img.crop((x, y, x + cw, y + ch)))
        out = img.copy()
        out.paste(patch, (random.randint(0, w - cw), random.randint(0, h - ch)))
        return out

    def _scar(self, img):
        w, h = img.size
        sw, sh = random.randint(*self.scar_w), random.randint(*self.scar_h)
        x, y = random.randint(0, w - sw), random.randint(0, h - sh)
        patch = self.jitter(img.crop((x, y, x + sw, y + sh))).convert("RGBA").rotate(random.uniform(-45, 45),
                                                                                        expand=True)
        out = img.copy()
        out.paste(patch, (random.randint(0, w - patch.size[0]), random.randint(0, h - patch.size[1])), mask=patch)
        return out

    def __call__(self, img):
        return img, self._cutpaste(img), self._scar(img)


class TrainSet(Dataset):
    def __init__(self, root, category, size):
        d = os.path.join(root, category, "train", "good")
        self.files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".png"))
        self.pre = transforms.Compose([transforms.Resize((size, size)), transforms.ColorJitter(0.1, 0.1, 0.1)])
        self.cp = CutPaste3Way()
        self.post = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = self.pre(Image.open(self.files[i]).convert("RGB"))
        return torch.stack([self.post(v) for v in self.cp(img)])


class EvalSet(Dataset):
    def __init__(self, root, category, split, size):
        base = os.path.join(root, category, split)
        self.items = [(os.path.join(base, d, f), int(d != "good"))
                      for d in sorted(os.listdir(base)) for f in sorted(os.listdir(os.path.join(base, d)))]
        self.tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), y


class ProjectionNet(nn.Module):
    def __init__(self, head_dims=(512, 512, 512, 512, 128), num_classes=3):
        super().__init__()
        self.backbone = resnet18(weights=ResNet18_Weights.IMAGENET1K_V1)
        self.backbone.fc = nn.Identity()
        layers, last = [], 512
        for d in head_dims:
            layers += [nn.Linear(last, d), nn.BatchNorm1d(d), nn.ReLU(True)]
            last = d
        self.head = nn.Sequential(*layers)
        self.out = nn.Linear(last, num_classes)

    def forward(self, x):
        emb = self.backbone(x)
        return emb, self.out(self.head(emb))


@torch.no_grad()
def embed(model, loader, device):
    model.eval()
    embs, labels = [], []
    for x, y in loader:
        e, _ = model(x.to(device))
        embs.append(F.normalize(e, dim=1).cpu())
        labels.append(y)
    model.train()
    return torch.cat(embs).numpy(), torch.cat(labels).numpy()


def gde_auroc(train_emb, test_emb, test_labels):
    lw = LedoitWolf().fit(train_emb)
    diff = test_emb - lw.location_
    scores = np.einsum("ij,jk,ik->i", diff, lw.precision_, diff)
    return roc_auc_score(test_labels, scores)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")

    train_ds = TrainSet(args.data, args.category, args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = ProjectionNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    lr = args.lr * world
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    out_dir = os.path.join(args.out, args.category)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        gde_train = DataLoader(EvalSet(args.data, args.category, "train", args.size), batch_size=64,
                               num_workers=4)
        gde_test = DataLoader(EvalSet(args.data, args.category, "test", args.size), batch_size=64, num_workers=4)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total, correct, loss_sum = 0, 0, 0.0
        for views in loader:
            b = views.shape[0]
            x = views.to(device, non_blocking=True).transpose(0, 1).reshape(3 * b, *views.shape[2:])
            y = torch.arange(3, device=device).repeat_interleave(b)
            _, logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            total += len(y)
        stats = torch.tensor([loss_sum, correct, total], device=device, dtype=torch.float64)
        dist.all_reduce(stats)

        if rank == 0:
            logger.info("epoch %d loss %.4f acc %.4f", epoch, stats[0] / stats[2], stats[1] / stats[2])
            if (epoch + 1) % 32 == 0 or epoch + 1 == args.epochs:
                tr_emb, _ = embed(model.module, gde_train, device)
                te_emb, te_y = embed(model.module, gde_test, device)
                auroc = gde_auroc(tr_emb, te_emb, te_y)
                logger.info("  GDE image AUROC %.4f", auroc)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auroc": auroc},
                           os.path.join(out_dir, f"cutpaste_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
