"""Multi-task protein sequence model: one shared transformer encoder, one head per task.
Every batch comes from a single task (task-homogeneous batches), so the other heads are idle.

    torchrun --nproc_per_node=4 12_multitask_transformer.py tasks=[stability,fluorescence,remote_homology]
"""
import contextlib
import logging
import math
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


class Encoder(nn.Module):
    def __init__(self, vocab_size, d_model, n_layers, n_heads, max_len, grad_ckpt=False):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.pos = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        ])
        self.norm = nn.LayerNorm(d_model)
        self.grad_ckpt = grad_ckpt

    def forward(self, ids, pad_mask):
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                h = checkpoint(layer, h, None, pad_mask, use_reentrant=False)
            else:
                h = layer(h, src_key_padding_mask=pad_mask)
        return self.norm(h)


class MultiTaskModel(nn.Module):
    def __init__(self, encoder, d_model, task_dims):
        super().__init__()
        self.encoder = encoder
        self.heads = nn.ModuleDict({
            name: nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Linear(d_model, out_dim))
            for name, out_dim in task_dims.items()
        })

    def forward(self, ids, pad_mask, task):
        h = self.encoder(ids, pad_mask)
        keep = (~pad_mask).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.heads[task](pooled)


def task_loss(kind, pred, target):
    if kind == "regression":
        return F.mse_loss(pred.squeeze(-1), target.float())
    return F.cross_entropy(pred, target)


def cycle(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(model, loaders, tasks_cfg, device):
    model.eval()
    results = {}
    for name, loader in loaders.items():
        s = torch.zeros(2, device=device)
        for ids, pad, y in loader:
            ids, pad, y = ids.to(device), pad.to(device), y.to(device)
            pred = model(ids, pad, name)
            if tasks_cfg[name].kind == "regression":
                s[0] += F.mse_loss(pred.squeeze(-1), y.float(), reduction="sum")
            else:
                s[0] += (pred.argmax(-1) == y).sum()
            s[1] += y.numel()
        dist.all_reduce(s)
        results[name] = (s[0] / s[1]).item()
    model.train()
    return results


@hydra.main(version_base="1.3", config_path="configs", config_name="multitask")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    if rank == 0:
        wandb.init(project=cfg.wandb.project, group=cfg.wandb.group, dir=out_dir,
                   config=OmegaConf.to_container(cfg, resolve=True))

    train_loaders, samplers, eval_loaders = {}, {}, {}
    for name in cfg.tasks:
        tcfg = cfg.task_defs[name]
        train_ds = instantiate(tcfg.train, root=to_absolute_path(cfg.data.root))
        val_ds = instantiate(tcfg.val, root=to_absolute_path(cfg.data.root))
        samplers[name] = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
        train_loaders[name] = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=samplers[name],
                                         collate_fn=train_ds.collate, num_workers=2, drop_last=True)
        eval_loaders[name] = DataLoader(val_ds, batch_size=cfg.train.batch_size,
                                        sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                                        collate_fn=val_ds.collate, num_workers=2, drop_last=True)

    encoder = Encoder(cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads,
                      cfg.model.max_len, grad_ckpt=cfg.model.grad_ckpt)
    task_dims = {name: cfg.task_defs[name].out_dim for name in cfg.tasks}
    model = MultiTaskModel(encoder, cfg.model.d_model, task_dims).to(device)
    # only one head is used per step, the rest get no gradient in that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    # lr in the config is for a global batch of 256 sequences
    global_batch = cfg.train.batch_size * world * cfg.train.accum_steps
    lr = cfg.optim.lr * global_batch / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.optim.weight_decay)
    warmup = cfg.train.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.train.steps))))

    iters = {name: cycle(train_loaders[name], samplers[name]) for name in cfg.tasks}
    weights = torch.tensor([cfg.task_defs[n].sample_weight for n in cfg.tasks], dtype=torch.float)
    gen = torch.Generator().manual_seed(cfg.seed)  # same task schedule on every rank

    model.train()
    for step in range(cfg.train.steps):
        for micro in range(cfg.train.accum_steps):
            name = cfg.tasks[torch.multinomial(weights, 1, generator=gen).item()]
            ids, pad, y = next(iters[name])
            ids, pad, y = ids.to(device, non_blocking=True), pad.to(device, non_blocking=True), y.to(device)
            last = micro == cfg.train.accum_steps - 1
            ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                pred = model(ids, pad, name)
                loss = task_loss(cfg.task_defs[name].kind, pred, y) / cfg.train.accum_steps
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)

        if rank == 0 and step % cfg.train.log_every == 0:
            wandb.log({"train/loss": loss.item() * cfg.train.accum_steps, "train/task": name,
                       "lr": sched.get_last_lr()[0]}, step=step)
        if (step + 1) % cfg.train.eval_every == 0:
            res = evaluate(model, eval_loaders, cfg.task_defs, device)
            if rank == 0:
                wandb.log({f"val/{k}": v for k, v in res.items()}, step=step)
                log.info("step %d %s", step, res)
                torch.save({"model": model.module.state_dict(), "step": step},
                           os.path.join(out_dir, "model.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
