"""Linear evaluation of a frozen DINO / iBOT backbone on a downstream dataset that ships
without an official validation split (a 90/10 split of the labelled images is held out)."""
import argparse
import json
import os
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser("linear eval")
    p.add_argument("--arch", default="vit_small_patch16_224")
    p.add_argument("--pretrained_weights", required=True)
    p.add_argument("--checkpoint_key", default="teacher")
    p.add_argument("--n_last_blocks", default=4, type=int)
    p.add_argument("--avgpool_patchtokens", default=False, action="store_true")
    p.add_argument("--data_path", default="/data/food101/images")
    p.add_argument("--val_fraction", default=0.1, type=float)
    p.add_argument("--epochs", default=100, type=int)
    p.add_argument("--lr", default=1e-3, type=float)
    p.add_argument("--batch_size_per_gpu", default=128, type=int)
    p.add_argument("--num_workers", default=8, type=int)
    p.add_argument("--val_freq", default=5, type=int)
    p.add_argument("--output_dir", default="./linear_food101")
    p.add_argument("--seed", default=0, type=int)
    return p.parse_args()


class LinearClassifier(nn.Module):
    def __init__(self, dim, num_labels):
        super().__init__()
        self.linear = nn.Linear(dim, num_labels)
        self.linear.weight.data.normal_(mean=0.0, std=0.01)
        self.linear.bias.data.zero_()

    def forward(self, x):
        return self.linear(x.view(x.size(0), -1))


def load_backbone(arch, path, key):
    model = timm.create_model(arch, num_classes=0)
    sd = torch.load(path, map_location="cpu")
    sd = sd.get(key, sd)
    sd = {k.replace("module.", "").replace("backbone.", ""): v for k, v in sd.items()}
    msg = model.load_state_dict(sd, strict=False)
    return model, msg


@torch.no_grad()
def extract(model, images, n, avgpool):
    intermediate = model.get_intermediate_layers(images, n, return_prefix_tokens=True, norm=True)
    output = torch.cat([cls[:, 0] for _, cls in intermediate], dim=-1)
    if avgpool:
        output = torch.cat((output, intermediate[-1][0].mean(dim=1)), dim=-1)
    return output


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=3), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    full_train = datasets.ImageFolder(args.data_path, transform=train_tf)
    full_val = datasets.ImageFolder(args.data_path, transform=val_tf)
    num_labels = len(full_train.classes)

    perm = torch.randperm(len(full_train)).tolist()
    n_val = int(len(perm) * args.val_fraction)
    train_set = Subset(full_train, perm[n_val:])
    val_set = Subset(full_val, perm[:n_val])

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, sampler=train_sampler, batch_size=args.batch_size_per_gpu,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    # strided shard of the held-out images (no padding, so the accuracy counts each image once)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size_per_gpu, shuffle=False,
                            num_workers=args.num_workers, pin_memory=True)
    if rank == 0:
        print(f"{len(train_set)} train / {len(val_set)} val images, {num_labels} classes")

    backbone, msg = load_backbone(args.arch, args.pretrained_weights, args.checkpoint_key)
    backbone.cuda().eval()
    for p in backbone.parameters():
        p.requires_grad = False
    if rank == 0:
        print(msg)
    embed_dim = backbone.embed_dim * (args.n_last_blocks + int(args.avgpool_patchtokens))

    linear = LinearClassifier(embed_dim, num_labels).cuda()
    linear = nn.parallel.DistributedDataParallel(linear, device_ids=[local_rank])
    lr = args.lr * (args.batch_size_per_gpu * world) / 256.
    optimizer = torch.optim.SGD(linear.parameters(), lr, momentum=0.9, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=0)

    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth.tar")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        linear.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best_acc = ck["epoch"], ck["best_acc"]
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        linear.train()
        tr = torch.zeros(2, device="cuda")
        for inp, target in train_loader:
            inp, target = inp.cuda(non_blocking=True), target.cuda(non_blocking=True)
            feats = extract(backbone, inp, args.n_last_blocks, args.avgpool_patchtokens)
            loss = nn.functional.cross_entropy(linear(feats), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tr += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        scheduler.step()
        dist.all_reduce(tr)

        if epoch % args.val_freq == 0 or epoch == args.epochs - 1:
            linear.eval()
            correct = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for inp, target in val_loader:
                    inp, target = inp.cuda(non_blocking=True), target.cuda(non_blocking=True)
                    out = linear.module(extract(backbone, inp, args.n_last_blocks, args.avgpool_patchtokens))
                    correct[0] += (out.argmax(1) == target).sum()
                    correct[1] += target.numel()
            dist.all_reduce(correct)
            acc = (100.0 * correct[0] / correct[1]).item()
            best_acc = max(best_acc, acc)
            if rank == 0:
                stats = {"epoch": epoch, "train_loss": (tr[0] / tr[1]).item(), "val_acc1": acc, "best": best_acc}
                print(json.dumps(stats), flush=True)
                with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                    f.write(json.dumps(stats) + "\n")
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": linear.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "best_acc": best_acc}, ckpt_path)

    if rank == 0:
        print(f"Training of the supervised linear classifier on frozen features completed.\n"
              f"Top-1 val accuracy: {best_acc:.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
