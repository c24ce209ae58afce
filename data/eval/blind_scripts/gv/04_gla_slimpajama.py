# Gated Linear Attention (fla) pretraining on pre-packed SlimPajama chunks.
#
#   torchrun --nnodes=1 --nproc_per_node=8 04_gla_slimpajama.py --data_dir /datasets/slimpj_packed_4k
#
import argparse
import logging
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from fla.models import GLAConfig, GLAForCausalLM

logger = logging.getLogger("gla")


@dataclass
class TrainConfig:
    data_dir: str = "/datasets/slimpj_packed_4k"
    out_dir: str = "out/gla_340m"
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_heads: int = 4
    expand_k: float = 0.5
    expand_v: float = 1.0
    vocab_size: int = 32000
    micro_batch: int = 8
    accum: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 1000
    total_steps: int = 30000
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_interval: int = 500
    eval_batches: int = 50
    ckpt_interval: int = 2500
    seed: int = 42


def parse() -> TrainConfig:
    cfg = TrainConfig()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    return TrainConfig(**vars(ap.parse_args()))


def collate(examples):
    ids = torch.tensor([e["input_ids"] for e in examples], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


def get_lr(step, cfg):
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    ratio = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * coeff)


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= cfg.eval_batches:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = batch["labels"][:, 1:].numel()
        total_loss += out.loss.item() * n
        total_tokens += n
    stats = torch.tensor([total_loss, total_tokens], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    cfg = parse()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    ds = load_from_disk(cfg.data_dir)
    train_ds, val_ds = ds["train"], ds["validation"]
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.micro_batch, sampler=val_sampler,
                            collate_fn=collate, num_workers=2)

    model_cfg = GLAConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                          num_heads=cfg.num_heads, expand_k=cfg.expand_k, expand_v=cfg.expand_v,
                          vocab_size=cfg.vocab_size, attn_mode="chunk", fuse_cross_entropy=True,
                          use_cache=False)
    model = GLAForCausalLM(model_cfg).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": nodecay, "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(0.9, 0.95), eps=1e-15, fused=True)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        n = sum(p.numel() for p in model.module.parameters())
        logger.info("GLA %.1fM params | world %d | tokens/step %d", n / 1e6, world,
                    cfg.micro_batch * cfg.accum * world * len(train_ds[0]["input_ids"]))

    step, epoch, micro = 0, 0, 0
    train_sampler.set_epoch(epoch)
    data_iter = iter(train_loader)
    tic = time.time()
    while step < cfg.total_steps:
        for g in optim.param_groups:
            g["lr"] = get_lr(step, cfg)

        loss_acc = torch.zeros((), device=device)
        for k in range(cfg.accum):
            try:
                batch = next(data_iter)
            except StopIteration:
                epoch += 1
                train_sampler.set_epoch(epoch)
                data_iter = iter(train_loader)
                batch = next(data_iter)
            batch = {k_: v.to(device, non_blocking=True) for k_, v in batch.items()}
            sync = k == cfg.accum - 1
            model.require_backward_grad_sync = sync
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / cfg.accum
            loss.backward()
            loss_acc += loss.detach()
            micro += 1

        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - tic) / 10
                logger.info("step %d | loss %.4f | gnorm %.3f | lr %.3e | %.2fs/step",
                            step, loss_acc.item(), gnorm.item(), get_lr(step, cfg), dt)
            tic = time.time()

        if step % cfg.eval_interval == 0:
            val = evaluate(model, val_loader, cfg, device)
            if rank == 0:
                logger.info("eval step %d | val_loss %.4f | ppl %.2f", step, val, math.exp(val))

        if step % cfg.ckpt_interval == 0 and rank == 0:
            path = os.path.join(cfg.out_dir, f"step{step}")
            model.module.save_pretrained(path, safe_serialization=True)
            torch.save({"optim": optim.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(path, "trainer_state.pt"))

    if rank == 0:
        model.module.save_pretrained(os.path.join(cfg.out_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
