#!/usr/bin/env python
"""Multi-task fine-tuning (intent / sentiment / topic) of a Chinese BERT on Ascend NPUs.

One shared encoder, one classification head per task. Every step draws a batch of a
single task, so the other two heads get no gradient in that step.

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    torchrun --nproc_per_node=8 07_npu_multitask_bert.py --config configs/mtl_base.yaml
"""
import argparse
import math
import os
import random
from collections import OrderedDict

import torch
import torch_npu  # noqa: F401
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from datasets import load_from_disk
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

TASKS = ("intent", "sentiment", "topic")


class MultiTaskModel(nn.Module):
    def __init__(self, encoder_name, num_labels, dropout=0.1):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(dropout)
        self.heads = nn.ModuleDict({t: nn.Linear(hidden, n) for t, n in num_labels.items()})

    def forward(self, task, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        pooled = self.dropout(out.last_hidden_state[:, 0])
        return self.heads[task](pooled)


def load_config(path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("seed", 42)
    cfg.setdefault("max_len", 128)
    cfg.setdefault("ref_batch", 32)
    return cfg


def strip_module_prefix(state_dict):
    return OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state_dict.items())


def task_schedule(loaders, epoch, seed):
    """Interleave batches of all tasks in a random order that is the same on every rank."""
    order = [t for t, dl in loaders.items() for _ in range(len(dl))]
    random.Random(seed + epoch).shuffle(order)
    return order


@torch.no_grad()
def evaluate(model, loaders, device):
    model.eval()
    results = {}
    for task, loader in loaders.items():
        preds, golds = [], []
        for batch in loader:
            labels = batch.pop("labels")
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(task, **batch)
            preds.extend(logits.argmax(-1).cpu().tolist())
            golds.extend(labels.tolist())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (preds, golds))
        all_p = [p for part in gathered for p in part[0]]
        all_g = [g for part in gathered for g in part[1]]
        results[task] = sum(int(p == g) for p, g in zip(all_p, all_g)) / max(len(all_g), 1)
    model.train()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cli = parser.parse_args()
    cfg = load_config(cli.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    dist.init_process_group(backend="hccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("npu", local_rank)
    torch.manual_seed(cfg["seed"])

    tokenizer = AutoTokenizer.from_pretrained(cfg["encoder"])
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    # pre-tokenized DatasetDicts on the shared volume (prepare_mtl_data.py)
    data = {t: load_from_disk(os.path.join(cfg["data_root"], t)) for t in TASKS}
    num_labels = {t: data[t]["train"].features["labels"].num_classes for t in TASKS}

    train_loaders, samplers, eval_loaders = {}, {}, {}
    for t in TASKS:
        samplers[t] = DistributedSampler(data[t]["train"], shuffle=True, seed=cfg["seed"], drop_last=True)
        train_loaders[t] = DataLoader(data[t]["train"], batch_size=cfg["batch_size"], sampler=samplers[t],
                                      collate_fn=collator, num_workers=2, drop_last=True)
        val = data[t]["validation"]
        eval_loaders[t] = DataLoader(Subset(val, range(rank, len(val), world_size)),
                                     batch_size=64, collate_fn=collator)

    model = MultiTaskModel(cfg["encoder"], num_labels)
    if cfg.get("init_from"):
        # checkpoint of an earlier DDP run; keys may carry the "module." prefix
        state = torch.load(cfg["init_from"], map_location="cpu")
        missing, unexpected = model.load_state_dict(strip_module_prefix(state["model"]), strict=False)
        if rank == 0:
            print(f"init_from: missing={missing} unexpected={unexpected}", flush=True)
    model.to(device)
    # each step only one head is used -> the other heads are unused in that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    # cfg["lr"] is tuned for a global batch of cfg["ref_batch"]; sqrt-scale for the actual one
    lr = cfg["lr"] * math.sqrt(cfg["batch_size"] * world_size / cfg["ref_batch"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = sum(len(dl) for dl in train_loaders.values())
    total = steps_per_epoch * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)
        print(f"world={world_size} steps/epoch={steps_per_epoch} labels={num_labels}", flush=True)

    best = -1.0
    for epoch in range(cfg["epochs"]):
        for s in samplers.values():
            s.set_epoch(epoch)
        iters = {t: iter(dl) for t, dl in train_loaders.items()}
        for step, task in enumerate(task_schedule(train_loaders, epoch, cfg["seed"])):
            batch = next(iters[task])
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("npu", dtype=torch.bfloat16):
                logits = model(task, **batch)
            loss = nn.functional.cross_entropy(logits.float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} task {task} loss {loss.item():.4f}", flush=True)

        acc = evaluate(model.module, eval_loaders, device)
        mean_acc = sum(acc.values()) / len(acc)
        if rank == 0:
            print(f"epoch {epoch} eval {acc} mean {mean_acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(cfg["output_dir"], "last.pt"))
            if mean_acc > best:
                best = mean_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(cfg["output_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
