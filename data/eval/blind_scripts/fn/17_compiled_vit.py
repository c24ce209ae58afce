"""ViT-S/16 from scratch on ImageNet-100 with torch.compile + DDP, bf16, early stopping.

    torchrun --nproc_per_node=8 17_compiled_vit.py compile=true init_from=null
    torchrun --nproc_per_node=8 17_compiled_vit.py init_from=outputs/vits_in1k/model_best.pt optim.lr=5e-4
"""
import logging
import os
import re

import hydra
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("linear_scale", lambda lr, bs, ws: lr * bs * ws / 512, replace=True)

_PREFIX = re.compile(r"^(module\.|_orig_mod\.)+")


def clean_state_dict(sd):
    # checkpoints from older runs were saved from the DDP / compiled wrapper
    return {_PREFIX.sub("", k): v for k, v in sd.items()}


def load_init(model, path, num_classes):
    sd = torch.load(path, map_location="cpu")
    sd = clean_state_dict(sd.get("model", sd))
    if sd["head.weight"].shape[0] != num_classes:
        sd.pop("head.weight")
        sd.pop("head.bias")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    log.info("init from %s: missing=%s unexpected=%s", path, missing, unexpected)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        s[0] += (out.argmax(-1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


@hydra.main(version_base="1.3", config_path="configs", config_name="vit")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    out_dir = HydraConfig.get().runtime.output_dir

    # one process logs, the others get a no-op run object
    run = wandb.init(project=cfg.wandb.project, name=HydraConfig.get().job.override_dirname or "default",
                     config=OmegaConf.to_container(cfg, resolve=True), dir=out_dir,
                     mode=cfg.wandb.mode if rank == 0 else "disabled")

    train_set = instantiate(cfg.data.train)
    val_set = instantiate(cfg.data.val)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # every rank gets a disjoint slice of the validation set (no padding duplicates);
    # evaluation runs on the plain module, so the uneven slice sizes are fine
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(val_shard, batch_size=cfg.data.batch_size * 2, shuffle=False,
                            num_workers=cfg.data.workers, pin_memory=True)

    model = timm.create_model(cfg.model.name, num_classes=cfg.data.num_classes,
                              drop_path_rate=cfg.model.drop_path)
    if cfg.init_from:
        load_init(model, to_absolute_path(cfg.init_from), cfg.data.num_classes)
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    # compile the DDP-wrapped module so Dynamo splits graphs at bucket boundaries
    train_model = torch.compile(ddp_model) if cfg.compile else ddp_model

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=(0.9, 0.999), fused=True)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.optim.lr, pct_start=cfg.optim.warmup_frac,
                                                    total_steps=cfg.train.epochs * steps_per_epoch,
                                                    anneal_strategy="cos")
    mixup = Mixup(mixup_alpha=cfg.aug.mixup, cutmix_alpha=cfg.aug.cutmix, label_smoothing=cfg.aug.smoothing,
                  num_classes=cfg.data.num_classes)
    criterion = SoftTargetCrossEntropy()

    best_acc, bad_epochs = 0.0, 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        train_model.train()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(train_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
            optimizer.step()
            scheduler.step()
            if it % cfg.train.log_every == 0:
                run.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]},
                        step=epoch * steps_per_epoch + it)

        acc = evaluate(model, val_loader, device)
        run.log({"val/acc": acc, "epoch": epoch}, step=(epoch + 1) * steps_per_epoch)

        # rank 0 owns the best / patience bookkeeping and broadcasts the stop decision
        decision = torch.zeros(1, device=device)
        if rank == 0:
            if acc > best_acc:
                best_acc, bad_epochs = acc, 0
                torch.save({"model": model.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(out_dir, "model_best.pt"))
            else:
                bad_epochs += 1
            decision[0] = float(bad_epochs >= cfg.train.patience)
            log.info("epoch %d val acc %.4f best %.4f", epoch, acc, best_acc)
        dist.broadcast(decision, src=0)
        if decision.item() > 0:
            if rank == 0:
                log.info("no improvement for %d epochs, stopping", cfg.train.patience)
            break

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
