"""Logit distillation: ResNet-50 teacher -> MobileNetV3 student on Tiny-ImageNet.

    torchrun --nproc_per_node=4 18_knowledge_distill.py teacher.ckpt=/models/r50_tin.pt kd.T=4 kd.alpha=0.9
    # resume an interrupted run in place
    torchrun --nproc_per_node=4 18_knowledge_distill.py hydra.run.dir=outputs/kd_r50_mbv3 resume=true
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


def kd_loss(student_logits, teacher_logits, labels, T, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=1), F.softmax(teacher_logits / T, dim=1),
                    reduction="batchmean") * (T * T)
    hard = F.cross_entropy(student_logits, labels)
    return alpha * soft + (1 - alpha) * hard, soft.detach(), hard.detach()


def build_teacher(cfg, device):
    teacher = instantiate(cfg.teacher.arch, num_classes=cfg.data.num_classes)
    sd = torch.load(to_absolute_path(cfg.teacher.ckpt), map_location="cpu")
    teacher.load_state_dict(sd["model"] if "model" in sd else sd)
    teacher.eval().requires_grad_(False)
    return teacher.to(device)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += y.size(0)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


@hydra.main(version_base="1.3", config_path="configs", config_name="distill")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir
    ckpt_path = os.path.join(out_dir, "kd_last.pt")
    writer = SummaryWriter(out_dir) if rank == 0 else None

    train_set = instantiate(cfg.data.train)
    val_set = instantiate(cfg.data.val)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler,
                            num_workers=cfg.data.workers, pin_memory=True)

    teacher = build_teacher(cfg, device)
    student_net = instantiate(cfg.student, num_classes=cfg.data.num_classes)

    start_epoch, best_acc, ckpt = 0, 0.0, None
    if cfg.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        student_net.load_state_dict(ckpt["student"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    student_net = nn.SyncBatchNorm.convert_sync_batchnorm(student_net).to(device)
    student = DDP(student_net, device_ids=[local_rank])
    optimizer = instantiate(cfg.optim, params=student.parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if rank == 0:
            log.info("resumed from epoch %d (best acc %.4f)", start_epoch, best_acc)
        del ckpt

    if rank == 0:
        log.info("teacher val acc %.4f", evaluate(teacher, val_loader, device))
    else:
        evaluate(teacher, val_loader, device)

    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(x)
            s_logits = student(x)
            loss, soft, hard = kd_loss(s_logits, t_logits, y, cfg.kd.T, cfg.kd.alpha)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % cfg.train.log_every == 0:
                step = epoch * len(train_loader) + it
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/kd", soft.item(), step)
                writer.add_scalar("train/ce", hard.item(), step)
        scheduler.step()

        acc = evaluate(student, val_loader, device)
        best_acc = max(best_acc, acc)
        if rank == 0:
            log.info("epoch %d student val acc %.4f (best %.4f)", epoch, acc, best_acc)
            writer.add_scalar("val/acc", acc, epoch)
            torch.save({"student": student.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                        "cfg": OmegaConf.to_container(cfg, resolve=True)}, ckpt_path)
            if acc >= best_acc:
                torch.save(student.state_dict(), os.path.join(out_dir, "student_best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
