"""Deep metric learning with Proxy-Anchor loss on Stanford Online Products / CUB / Cars.

Embeddings and labels of the whole global batch are gathered so that every proxy sees the
positives and negatives of all GPUs.

    torchrun --nproc_per_node=4 12_sop_proxy_anchor.py --dataset sop --data-root /data/Stanford_Online_Products \
        --embedding-size 512 --batch-size 45 --epochs 60 --out runs/pa_sop_r50
"""
import argparse
import os
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="sop", choices=["sop"])
    p.add_argument("--data-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=45, help="per GPU")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=6e-4, help="for 4 GPUs x 45 images")
    p.add_argument("--proxy-lr-mult", type=float, default=100.0)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--mrg", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class SOP(Dataset):
    def __init__(self, root, split, transform):
        self.transform = transform
        info = os.path.join(root, "Ebay_train.txt" if split == "train" else "Ebay_test.txt")
        with open(info) as f:
            lines = f.read().splitlines()[1:]
        self.paths, self.labels = [], []
        for line in lines:
            _, class_id, _, path = line.split()
            self.paths.append(os.path.join(root, path))
            self.labels.append(int(class_id) - 1)
        # test classes are 11319..22633 in the file; map them to 0..N-1
        offset = min(self.labels)
        self.labels = [l - offset for l in self.labels]
        self.num_classes = max(self.labels) + 1

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(self.paths[i]).convert("RGB")), self.labels[i]


class AllGatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        n = grad.shape[0] // dist.get_world_size()
        r = dist.get_rank()
        return grad[r * n:(r + 1) * n]


def gather_labels(y):
    out = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(out, y)
    return torch.cat(out)


class ProxyAnchorNet(nn.Module):
    def __init__(self, backbone, embedding_size, num_classes, alpha, mrg):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0, global_pool="")
        self.embedding = nn.Linear(self.backbone.num_features, embedding_size)
        nn.init.orthogonal_(self.embedding.weight)
        nn.init.zeros_(self.embedding.bias)
        self.proxies = nn.Parameter(torch.randn(num_classes, embedding_size))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")
        self.alpha, self.mrg, self.num_classes = alpha, mrg, num_classes

    def embed(self, x):
        f = self.backbone(x)
        f = F.adaptive_avg_pool2d(f, 1) + F.adaptive_max_pool2d(f, 1)
        return self.embedding(f.flatten(1))

    def forward(self, x, labels):
        emb = AllGatherGrad.apply(self.embed(x).contiguous())
        labels = gather_labels(labels)
        cos = F.linear(F.normalize(emb), F.normalize(self.proxies))
        p_one_hot = F.one_hot(labels, self.num_classes).float()
        n_one_hot = 1 - p_one_hot
        pos_exp = torch.exp(-self.alpha * (cos - self.mrg))
        neg_exp = torch.exp(self.alpha * (cos + self.mrg))
        with_pos = torch.nonzero(p_one_hot.sum(0) != 0).squeeze(1)
        p_sim_sum = torch.where(p_one_hot == 1, pos_exp, torch.zeros_like(pos_exp)).sum(0)
        n_sim_sum = torch.where(n_one_hot == 1, neg_exp, torch.zeros_like(neg_exp)).sum(0)
        pos_term = torch.log(1 + p_sim_sum).sum() / len(with_pos)
        neg_term = torch.log(1 + n_sim_sum).sum() / self.num_classes
        return pos_term + neg_term


def freeze_bn(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)


@torch.no_grad()
def recall_at_k(net, loader, device, ks=(1, 10, 100, 1000)):
    net.eval()
    feats, labels = [], []
    for x, y in loader:
        feats.append(F.normalize(net.embed(x.to(device, non_blocking=True))).cpu())
        labels.append(y)
    feats, labels = torch.cat(feats), torch.cat(labels)
    recalls = {k: 0 for k in ks}
    for chunk in torch.arange(len(feats)).split(4096):
        sim = feats[chunk].to(device) @ feats.to(device).t()
        sim[torch.arange(len(chunk)), chunk.to(device)] = -2  # drop the query itself
        nn_idx = sim.topk(max(ks), dim=1).indices.cpu()
        hit = labels[nn_idx] == labels[chunk].unsqueeze(1)
        for k in ks:
            recalls[k] += hit[:, :k].any(1).sum().item()
    return {k: v / len(feats) for k, v in recalls.items()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize([104 / 255.0, 117 / 255.0, 128 / 255.0], [1.0 / 255, 1.0 / 255, 1.0 / 255])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), normalize])
    train_set = SOP(args.data_root, "train", train_tf)
    test_set = SOP(args.data_root, "test", test_tf)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)

    model = ProxyAnchorNet(args.backbone, args.embedding_size, train_set.num_classes, args.alpha, args.mrg)
    model = model.to(device)
    freeze_bn(model.backbone)
    model = DDP(model, device_ids=[local_rank])
    net = model.module
    optimizer = torch.optim.AdamW([
        {"params": net.backbone.parameters(), "lr": args.lr},
        {"params": net.embedding.parameters(), "lr": args.lr},
        {"params": [net.proxies], "lr": args.lr * args.proxy_lr_mult},
    ], lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    best_r1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        freeze_bn(net.backbone)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 10)
            optimizer.step()
            if it % 100 == 0 and rank == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        if rank == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            test_loader = DataLoader(test_set, batch_size=256, num_workers=8)
            rec = recall_at_k(net, test_loader, device)
            print(f"epoch {epoch} " + " ".join(f"R@{k}={100 * v:.2f}" for k, v in rec.items()), flush=True)
            os.makedirs(args.out, exist_ok=True)
            if rec[1] > best_r1:
                best_r1 = rec[1]
                torch.save({"model": net.state_dict(), "epoch": epoch, "recall": rec},
                           os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
