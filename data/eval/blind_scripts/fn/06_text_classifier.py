"""Fine-tune a HF encoder for sentence classification (GLUE-style tasks).

    torchrun --nproc_per_node=4 06_text_classifier.py task=mnli model.name=roberta-base
    torchrun --nproc_per_node=4 06_text_classifier.py -m task=sst2,qnli optim.lr=1e-5,2e-5,3e-5
"""
import logging
import os

import hydra
import torch
import torch.distributed as dist
from datasets import load_from_disk
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("task_dir", lambda task: f"glue_{task}", replace=True)

TASK_KEYS = {
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "cola": ("sentence", None),
}


def encode_dataset(ds, tokenizer, task, max_len):
    k1, k2 = TASK_KEYS[task]

    def _tok(batch):
        if k2 is None:
            return tokenizer(batch[k1], truncation=True, max_length=max_len)
        return tokenizer(batch[k1], batch[k2], truncation=True, max_length=max_len)

    cols = [c for c in ds.column_names if c != "label"]
    ds = ds.map(_tok, batched=True, remove_columns=cols)
    ds = ds.rename_column("label", "labels")
    ds.set_format("torch")
    return ds


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        loss_sum += out.loss.item() * batch["labels"].size(0)
        correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
        total += batch["labels"].size(0)
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    correct, total, loss_sum = stats.tolist()
    model.train()
    return correct / total, loss_sum / total


@hydra.main(version_base="1.3", config_path="configs", config_name="glue")
def main(cfg: DictConfig) -> float:
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    out_dir = HydraConfig.get().runtime.output_dir
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    # datasets were pre-downloaded and saved with save_to_disk on the login node
    raw = load_from_disk(to_absolute_path(os.path.join(cfg.data.root, cfg.data.subdir)))
    # rank 0 tokenizes and writes the datasets cache, the others then read it
    if rank != 0:
        dist.barrier()
    train_ds = encode_dataset(raw["train"], tokenizer, cfg.task, cfg.data.max_len)
    eval_ds = encode_dataset(raw[cfg.data.eval_split], tokenizer, cfg.task, cfg.data.max_len)
    if rank == 0:
        dist.barrier()

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=cfg.train.eval_batch_size, sampler=eval_sampler,
                             collate_fn=collator, num_workers=4, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model.name, num_labels=cfg.data.num_labels).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": cfg.optim.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = instantiate(cfg.optim.optimizer, params=groups)
    total_steps = cfg.train.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.train.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.train.fp16)

    best_acc = 0.0
    step = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.train.fp16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.train.log_every == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, total_steps, loss.item())

        acc, eval_loss = evaluate(model, eval_loader, device)
        if rank == 0:
            log.info("epoch %d eval acc %.4f loss %.4f", epoch, acc, eval_loss)
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(out_dir, "best"))
                tokenizer.save_pretrained(os.path.join(out_dir, "best"))
        best_acc = max(best_acc, acc)

    dist.destroy_process_group()
    # returned value is used by the optuna sweeper in multirun mode
    return best_acc


if __name__ == "__main__":
    main()
