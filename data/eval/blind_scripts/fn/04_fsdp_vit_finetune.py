"""Fine-tune a ViT-L/16 (timm) on iNaturalist with FSDP.

    torchrun --nproc_per_node=8 04_fsdp_vit_finetune.py model=vit_large data=inat21 optim.lr=5e-5
"""
import functools
import logging
import os
import time

import hydra
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("eval", eval, replace=True)


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_model(cfg):
    model = timm.create_model(
        cfg.model.name,
        pretrained=cfg.model.pretrained,
        num_classes=cfg.data.num_classes,
        drop_path_rate=cfg.model.drop_path,
    )
    return model


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        correct += (logits.argmax(-1) == labels).sum()
        count += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    return (correct / count).item()


def save_checkpoint(model, path, epoch, acc):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    torch.save({"model": state, "epoch": epoch, "acc": acc}, path)
    log.info("saved checkpoint to %s (acc %.4f)", path, acc)


@hydra.main(version_base="1.3", config_path="configs", config_name="finetune")
def main(cfg: DictConfig):
    rank, world_size, local_rank = setup()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    train_ds = instantiate(cfg.data.train)
    val_ds = instantiate(cfg.data.val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.data.eval_batch_size, sampler=val_sampler,
                            num_workers=cfg.data.workers, pin_memory=True)

    model = build_model(cfg)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        model,
        auto_wrap_policy=policy,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=local_rank,
        limit_all_gathers=True,
        use_orig_params=True,
    )

    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas))
    total_steps = cfg.train.epochs * len(train_loader)
    scheduler = instantiate(cfg.sched, optimizer=optimizer, total_steps=total_steps)
    mixup = instantiate(cfg.mixup) if cfg.get("mixup") else None
    criterion = (timm.loss.SoftTargetCrossEntropy() if mixup is not None
                 else nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing))

    best_acc = 0.0
    step = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if mixup is not None:
                images, labels = mixup(images, labels)
            logits = model(images)
            loss = criterion(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.train.log_every == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.3e", epoch, step, total_steps,
                         loss.item(), scheduler.get_last_lr()[0])

        acc = evaluate(model, val_loader, device)
        if rank == 0:
            log.info("epoch %d done in %.0fs, val top-1 %.4f", epoch, time.time() - tic, acc)

        if acc > best_acc:
            best_acc = acc
            if rank == 0:
                save_checkpoint(model, os.path.join(out_dir, "best.pt"), epoch, acc)
        dist.barrier()

    if rank == 0:
        log.info("finished, best val top-1 %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
