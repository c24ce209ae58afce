"""Fine-tune an encoder for multi-label ticket classification.

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 \
        train_cls.py data.train_path=s3://tickets/v7/train.jsonl model.name=microsoft/deberta-v3-base
"""
import json
import logging
import os
import time

import fsspec
import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from omegaconf import DictConfig, OmegaConf
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("train_cls")


def read_jsonl(url):
    with fsspec.open(url, "rt") as f:
        return [json.loads(line) for line in f]


def build_features(cfg, tokenizer, split, label_names):
    """Tokenize a split once and keep the tensors on the shared cache volume."""
    tag = cfg.model.name.replace("/", "__")
    cache_path = os.path.join(cfg.data.cache_dir, f"{split}.{tag}.len{cfg.data.max_len}.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path)

    rows = read_jsonl(cfg.data[f"{split}_path"])
    enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=cfg.data.max_len,
                    padding="max_length", return_tensors="pt")
    label_idx = {name: i for i, name in enumerate(label_names)}
    labels = torch.zeros(len(rows), len(label_names))
    for i, r in enumerate(rows):
        for name in r["labels"]:
            labels[i, label_idx[name]] = 1.0
    features = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    os.makedirs(cfg.data.cache_dir, exist_ok=True)
    torch.save(features, cache_path)
    return features


class Classifier(nn.Module):
    def __init__(self, name, num_labels, dropout):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(self.dropout(pooled))


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    probs, golds = [], []
    for ids, mask, y in loader:
        logits = model(ids.to(device), mask.to(device))
        probs.append(torch.sigmoid(logits.float()))
        golds.append(y.to(device))
    probs, golds = torch.cat(probs), torch.cat(golds)
    gathered = [None] * world
    dist.all_gather_object(gathered, (probs.cpu(), golds.cpu()))
    model.train()
    all_p = torch.cat([p for p, _ in gathered]).numpy()
    all_y = torch.cat([y for _, y in gathered]).numpy()
    return {
        "micro_f1": f1_score(all_y, all_p > 0.5, average="micro", zero_division=0),
        "macro_f1": f1_score(all_y, all_p > 0.5, average="macro", zero_division=0),
    }


@hydra.main(config_path="conf", config_name="cls", version_base=None)
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    if rank == 0:
        wandb.init(project=cfg.wandb.project, name=cfg.run_name, group=cfg.wandb.group,
                   config=OmegaConf.to_container(cfg, resolve=True))

    label_names = [l.strip() for l in fsspec.open(cfg.data.labels_path, "rt").open().read().splitlines() if l.strip()]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    train = build_features(cfg, tokenizer, "train", label_names)
    valid = build_features(cfg, tokenizer, "valid", label_names)
    train_ds = TensorDataset(train["input_ids"], train["attention_mask"], train["labels"])
    valid_ds = TensorDataset(valid["input_ids"], valid["attention_mask"], valid["labels"])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)),
                              batch_size=cfg.train.batch_size * 2, num_workers=2)

    model = Classifier(cfg.model.name, len(label_names), cfg.model.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = ("bias", "LayerNorm.weight", "layernorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": cfg.train.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr)
    total = len(train_loader) * cfg.train.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.train.warmup_ratio * total), total)
    loss_fn = nn.BCEWithLogitsLoss()

    out_dir = cfg.run_dir
    ckpt_path = os.path.join(out_dir, "last.pt")
    start_epoch, best = 0, -1.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.train.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, mask, y in train_loader:
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, mask)
            loss = loss_fn(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/lr": scheduler.get_last_lr()[0]}, step=step)

        metrics = evaluate(model.module, valid_loader, device, world)
        if rank == 0:
            wandb.log({f"valid/{k}": v for k, v in metrics.items()} | {"epoch_time": time.time() - t0}, step=step)
            log.info("epoch %d %s", epoch, metrics)
            os.makedirs(out_dir, exist_ok=True)
            best = max(best, metrics["micro_f1"])
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
            if metrics["micro_f1"] >= best:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
