"""Fine-grained classification (CUB-200) with an auxiliary rotation-prediction task.
The rotation loss is switched on after a few warm-up epochs of plain supervised training.

    torchrun --nproc_per_node=4 13_rotation_aux_cls.py backbone=resnet50 aux.start_epoch=5 aux.weight=0.5
"""
import logging
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


class ClsWithRotation(nn.Module):
    def __init__(self, backbone, feat_dim, num_classes):
        super().__init__()
        self.backbone = backbone
        self.backbone.fc = nn.Identity()
        self.cls_head = nn.Linear(feat_dim, num_classes)
        self.rot_head = nn.Sequential(nn.Linear(feat_dim, 512), nn.ReLU(inplace=True), nn.Linear(512, 4))

    def forward(self, x, rot_x=None):
        logits = self.cls_head(self.backbone(x))
        if rot_x is None:
            return logits, None
        return logits, self.rot_head(self.backbone(rot_x))


def make_rotations(x):
    """Rotate every image by a random multiple of 90 degrees; returns images and rotation labels."""
    k = torch.randint(0, 4, (x.size(0),), device=x.device)
    out = torch.stack([torch.rot90(img, int(r), dims=(1, 2)) for img, r in zip(x, k)])
    return out, k


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hit = torch.zeros(1, device=device)
    cnt = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, _ = model(x)
        hit += (logits.argmax(1) == y).sum()
        cnt += y.numel()
    dist.all_reduce(hit)
    dist.all_reduce(cnt)
    model.train()
    return (hit / cnt).item()


@hydra.main(version_base="1.3", config_path="configs", config_name="cub")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir
    tb = SummaryWriter(out_dir) if rank == 0 else None

    train_set = instantiate(cfg.data.train, root=to_absolute_path(cfg.data.root))
    test_set = instantiate(cfg.data.test, root=to_absolute_path(cfg.data.root))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=False)
    train_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=cfg.train.batch_size, sampler=test_sampler,
                             num_workers=cfg.data.workers, pin_memory=True)

    backbone = instantiate(cfg.backbone)
    model = ClsWithRotation(backbone, cfg.backbone_dim, cfg.data.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    head_names = ("cls_head", "rot_head")
    head_params = [p for n, p in model.module.named_parameters() if n.startswith(head_names)]
    body_params = [p for n, p in model.module.named_parameters() if not n.startswith(head_names)]
    optimizer = torch.optim.SGD([
        {"params": body_params, "lr": cfg.optim.lr},
        {"params": head_params, "lr": cfg.optim.lr * cfg.optim.head_lr_mult},
    ], lr=cfg.optim.lr, momentum=0.9, weight_decay=cfg.optim.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs * len(train_loader))

    best = 0.0
    step = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        use_aux = epoch >= cfg.aux.start_epoch
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if use_aux:
                rot_x, rot_y = make_rotations(x)
                logits, rot_logits = model(x, rot_x)
                cls_loss = F.cross_entropy(logits, y, label_smoothing=cfg.train.label_smoothing)
                rot_loss = F.cross_entropy(rot_logits, rot_y)
                loss = cls_loss + cfg.aux.weight * rot_loss
            else:
                logits, _ = model(x)
                cls_loss = F.cross_entropy(logits, y, label_smoothing=cfg.train.label_smoothing)
                rot_loss = torch.zeros((), device=device)
                loss = cls_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % cfg.train.log_every == 0:
                tb.add_scalar("train/cls_loss", cls_loss.item(), step)
                tb.add_scalar("train/rot_loss", rot_loss.item(), step)
                tb.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
            step += 1

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            log.info("epoch %d aux=%s test acc %.4f", epoch, use_aux, acc)
            tb.add_scalar("test/acc", acc, epoch)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc,
                            "cfg": OmegaConf.to_container(cfg, resolve=True)}, os.path.join(out_dir, "best.pt"))
        best = max(best, acc)

    if rank == 0:
        tb.close()
        log.info("best acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
