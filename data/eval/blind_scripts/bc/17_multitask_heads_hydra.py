"""Multi-task support-ticket model: one shared encoder, one head per task (routing, priority,
language, sentiment). Each optimizer step draws a single task, so the other heads get no
gradient in that step.

    torchrun --nnodes=2 --nproc-per-node=4 --max-restarts=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID train_mt.py trainer.epochs=5

data.cache_dir and trainer.out_dir point at /fsx (shared by all nodes) in conf/multitask.yaml.
"""
import logging
import os
import random
import time

import hydra
import mlflow
import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

from tickets.io import read_task_split

log = logging.getLogger(__name__)


def cached_features(cfg, task, split, tokenizer, rank):
    """Rank 0 tokenizes and writes the cache; everyone else waits, then reads it."""
    path = os.path.join(cfg.data.cache_dir, f"{task}.{split}.{cfg.model.max_len}.pt")
    if rank == 0 and not os.path.exists(path):
        texts, labels = read_task_split(cfg.data.root, task, split)
        enc = tokenizer(texts, max_length=cfg.model.max_len, truncation=True, padding="max_length",
                        return_tensors="pt")
        os.makedirs(cfg.data.cache_dir, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save({"ids": enc["input_ids"], "mask": enc["attention_mask"],
                    "y": torch.tensor(labels)}, tmp)
        os.replace(tmp, path)
    dist.barrier()
    d = torch.load(path)
    return TensorDataset(d["ids"], d["mask"], d["y"])


class MultiTaskModel(nn.Module):
    def __init__(self, name, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        hid = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.1), nn.Linear(hid, n))
                                    for t, n in num_labels.items()})

    def forward(self, ids, mask, task):
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return self.heads[task](h)


@torch.no_grad()
def evaluate(net, loaders, device):
    net.eval()
    out = {}
    for task, loader in loaders.items():
        s = torch.zeros(2, device=device)
        for ids, mask, y in loader:
            logits = net(ids.to(device), mask.to(device), task)
            s[0] += (logits.argmax(-1) == y.to(device)).sum()
            s[1] += y.numel()
        dist.all_reduce(s)
        out[task] = (s[0] / s[1]).item()
    net.train()
    return out


@hydra.main(config_path="conf", config_name="multitask", version_base="1.3")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    tasks = list(cfg.tasks.keys())
    train_sets = {t: cached_features(cfg, t, "train", tokenizer, rank) for t in tasks}
    val_sets = {t: cached_features(cfg, t, "val", tokenizer, rank) for t in tasks}
    samplers = {t: DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
                for t, ds in train_sets.items()}
    train_loaders = {t: DataLoader(train_sets[t], batch_size=cfg.trainer.batch_size, sampler=samplers[t],
                                   num_workers=2, pin_memory=True, drop_last=True) for t in tasks}
    val_loaders = {t: DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256)
                   for t, ds in val_sets.items()}

    net = MultiTaskModel(cfg.model.name, {t: cfg.tasks[t].num_labels for t in tasks}).to(device)
    # only the sampled task's head is used in a step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    steps_per_epoch = sum(len(l) for l in train_loaders.values())
    total_steps = steps_per_epoch * cfg.trainer.epochs
    lr = cfg.trainer.base_lr * cfg.trainer.batch_size * world / cfg.trainer.base_batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.06 * total_steps), total_steps)
    loss_fn = nn.CrossEntropyLoss()

    ckpt_path = os.path.join(cfg.trainer.out_dir, "last.pt")
    start_epoch, run_id = 0, None
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, run_id = ck["epoch"] + 1, ck["run_id"]

    if rank == 0:
        os.makedirs(cfg.trainer.out_dir, exist_ok=True)
        mlflow.set_tracking_uri(cfg.mlflow.uri)
        mlflow.set_experiment(cfg.mlflow.experiment)
        run_id = mlflow.start_run(run_id=run_id).info.run_id
        mlflow.log_params({"world_size": world, "lr": lr, **OmegaConf.to_container(cfg.trainer)})

    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, cfg.trainer.epochs):
        for s in samplers.values():
            s.set_epoch(epoch)
        iters = {t: iter(l) for t, l in train_loaders.items()}
        # the same schedule of tasks on every rank: seeded by epoch, not by rank
        schedule = [t for t in tasks for _ in range(len(train_loaders[t]))]
        random.Random(cfg.seed + epoch).shuffle(schedule)
        t0 = time.time()
        for task in schedule:
            ids, mask, y = next(iters[task])
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, mask, task)
            loss = loss_fn(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.trainer.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metrics({f"loss/{task}": l.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        accs = evaluate(net, val_loaders, device)
        if rank == 0:
            mlflow.log_metrics({f"val_acc/{t}": a for t, a in accs.items()} | {"epoch_s": time.time() - t0},
                               step=step)
            log.info("epoch %d %s", epoch, accs)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "run_id": run_id},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
