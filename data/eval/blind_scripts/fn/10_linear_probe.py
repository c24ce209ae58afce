"""Linear probing of a frozen self-supervised backbone on ImageNet-1k.

    torchrun --nproc_per_node=8 10_linear_probe.py backbone.ckpt=/ckpts/dino_vits16.pth probe.lr=0.01
"""
import logging
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("scale_lr", lambda lr, bs: lr * bs / 256, replace=True)


class LinearClassifier(nn.Module):
    def __init__(self, dim, num_labels=1000):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, num_labels)
        self.linear.weight.data.normal_(mean=0.0, std=0.01)
        self.linear.bias.data.zero_()

    def forward(self, x):
        return self.linear(self.bn(x))


def load_backbone(cfg, device):
    backbone = instantiate(cfg.backbone.arch)
    state = torch.load(to_absolute_path(cfg.backbone.ckpt), map_location="cpu")
    state = state.get(cfg.backbone.ckpt_key, state)
    state = {k.replace("module.", "").replace("backbone.", ""): v for k, v in state.items()}
    msg = backbone.load_state_dict(state, strict=False)
    log.info("backbone load: %s", msg)
    for p in backbone.parameters():
        p.requires_grad = False
    return backbone.eval().to(device)


@torch.no_grad()
def extract(backbone, x, n_last_blocks, avgpool):
    feats = backbone.get_intermediate_layers(x, n_last_blocks)
    out = torch.cat([f[:, 0] for f in feats], dim=-1)
    if avgpool:
        out = torch.cat([out, feats[-1][:, 1:].mean(1)], dim=-1)
    return out


@torch.no_grad()
def validate(backbone, head, loader, device, cfg):
    head.eval()
    top1 = torch.zeros(1, device=device)
    top5 = torch.zeros(1, device=device)
    n = torch.zeros(1, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            feats = extract(backbone, images, cfg.probe.n_last_blocks, cfg.probe.avgpool)
        logits = head(feats.float())
        _, pred = logits.topk(5, 1)
        hit = pred.eq(target.view(-1, 1))
        top1 += hit[:, 0].sum()
        top5 += hit.any(1).sum()
        n += target.numel()
    for t in (top1, top5, n):
        dist.all_reduce(t)
    head.train()
    return (100 * top1 / n).item(), (100 * top5 / n).item()


@hydra.main(version_base="1.3", config_path="configs", config_name="linear")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(256, interpolation=3), transforms.CenterCrop(224),
                                 transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(to_absolute_path(cfg.data.root), "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(to_absolute_path(cfg.data.root), "val"), val_tf)

    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, sampler=sampler, batch_size=cfg.data.batch_size_per_gpu,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, sampler=DistributedSampler(val_set, shuffle=False),
                            batch_size=cfg.data.batch_size_per_gpu, num_workers=cfg.data.workers,
                            pin_memory=True)

    backbone = load_backbone(cfg, device)
    feat_dim = backbone.embed_dim * (cfg.probe.n_last_blocks + int(cfg.probe.avgpool))
    head = LinearClassifier(feat_dim, cfg.data.num_classes).to(device)
    head = DDP(head, device_ids=[local_rank])

    # lr is given for a global batch of 256 and scaled by the ${scale_lr:} resolver in the yaml
    optimizer = torch.optim.SGD(head.parameters(), lr=cfg.probe.lr, momentum=0.9, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.probe.epochs, eta_min=0)
    criterion = nn.CrossEntropyLoss()

    writer = SummaryWriter(os.path.join(out_dir, "tb")) if rank == 0 else None
    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(out_dir, "checkpoint.pth.tar")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        head.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"], ckpt["best_acc"]

    for epoch in range(start_epoch, cfg.probe.epochs):
        head.train()
        for it, (images, target) in enumerate(train_loader):
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                feats = extract(backbone, images, cfg.probe.n_last_blocks, cfg.probe.avgpool)
            loss = criterion(head(feats.float()), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % cfg.log_every == 0:
                gstep = epoch * len(train_loader) + it
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], gstep)
        scheduler.step()

        if (epoch + 1) % cfg.probe.val_freq == 0 or epoch + 1 == cfg.probe.epochs:
            acc1, acc5 = validate(backbone, head, val_loader, device, cfg)
            best_acc = max(best_acc, acc1)
            if rank == 0:
                log.info("epoch %d: top-1 %.2f top-5 %.2f (best %.2f)", epoch, acc1, acc5, best_acc)
                writer.add_scalar("val/acc1", acc1, epoch)
                writer.add_scalar("val/acc5", acc5, epoch)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": head.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "best_acc": best_acc}, ckpt_path)

    if rank == 0:
        log.info("linear probe done, best top-1 %.2f", best_acc)
        with open(os.path.join(out_dir, "result.txt"), "w") as f:
            f.write(f"{best_acc:.3f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
