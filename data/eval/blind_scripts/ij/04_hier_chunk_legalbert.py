"""ECtHR (LexGLUE, task A) multi-label violation prediction with a hierarchical
LEGAL-BERT: each case is a list of facts paragraphs, the paragraphs are encoded
independently and a paragraph-level transformer + max pooling gives the case vector.

Run:
    torchrun --standalone --nproc_per_node=4 04_hier_chunk_legalbert.py --config configs/ecthr_a.yaml
"""
import argparse
import logging
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from datasets import load_dataset
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("ecthr")


@dataclass
class Config:
    encoder: str = "nlpaueb/legal-bert-base-uncased"
    max_paragraphs: int = 64
    paragraph_len: int = 128
    batch_size: int = 4
    lr: float = 3e-5
    epochs: int = 15
    warmup_ratio: float = 0.1
    patience: int = 3
    seed: int = 42
    output_dir: str = "runs/ecthr_a_hier"
    gradient_checkpointing: bool = True
    num_workers: int = 4
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    return cfg


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ParagraphCollator:
    def __init__(self, tokenizer, max_paragraphs, paragraph_len, num_labels):
        self.tok = tokenizer
        self.max_paragraphs = max_paragraphs
        self.paragraph_len = paragraph_len
        self.num_labels = num_labels

    def __call__(self, examples):
        B, P, L = len(examples), self.max_paragraphs, self.paragraph_len
        input_ids = torch.full((B, P, L), self.tok.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, P, L), dtype=torch.long)
        para_mask = torch.zeros((B, P), dtype=torch.bool)
        labels = torch.zeros((B, self.num_labels))
        for i, ex in enumerate(examples):
            paras = ex["text"][:P]
            enc = self.tok(paras, truncation=True, max_length=L, padding="max_length", return_tensors="pt")
            n = enc["input_ids"].size(0)
            input_ids[i, :n] = enc["input_ids"]
            attention_mask[i, :n] = enc["attention_mask"]
            para_mask[i, :n] = True
            labels[i, ex["labels"]] = 1.0
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "para_mask": para_mask, "labels": labels}


class HierLegalBert(nn.Module):
    def __init__(self, cfg, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(cfg.encoder, add_pooling_layer=False)
        if cfg.gradient_checkpointing:
            self.encoder.gradient_checkpointing_enable()
        d = self.encoder.config.hidden_size
        self.para_pos = nn.Embedding(cfg.max_paragraphs, d)
        self.para_encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.1, activation="gelu", batch_first=True),
            num_layers=2,
        )
        self.out = nn.Linear(d, num_labels)

    def forward(self, input_ids, attention_mask, para_mask):
        B, P, L = input_ids.shape
        # paragraphs are encoded one slot at a time to keep activation memory flat
        para_vecs = []
        for p in range(P):
            h = self.encoder(input_ids=input_ids[:, p], attention_mask=attention_mask[:, p]).last_hidden_state
            para_vecs.append(h[:, 0])
        x = torch.stack(para_vecs, dim=1)
        x = x + self.para_pos.weight[:P].unsqueeze(0)
        x = self.para_encoder(x, src_key_padding_mask=~para_mask)
        x = x.masked_fill(~para_mask.unsqueeze(-1), -1e4)
        return self.out(x.max(dim=1).values)


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    all_logits, all_labels = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["input_ids"], batch["attention_mask"], batch["para_mask"])
        all_logits.append(logits.float())
        all_labels.append(batch["labels"])
    logits = torch.cat(all_logits)
    labels = torch.cat(all_labels)
    # equal-sized shards (DistributedSampler pads), so a tensor all_gather works;
    # the padded duplicates are cut off using the known dataset length
    g_logits = [torch.empty_like(logits) for _ in range(world_size)]
    g_labels = [torch.empty_like(labels) for _ in range(world_size)]
    dist.all_gather(g_logits, logits)
    dist.all_gather(g_labels, labels)
    n = len(loader.dataset)
    # DistributedSampler (shuffle=False) hands index i to rank i % world_size
    logits = torch.stack(g_logits, dim=1).reshape(-1, logits.size(-1))[:n]
    labels = torch.stack(g_labels, dim=1).reshape(-1, labels.size(-1))[:n]
    preds = (torch.sigmoid(logits) > 0.5).cpu().numpy()
    gold = labels.cpu().numpy()
    model.train()
    return {
        "micro_f1": f1_score(gold, preds, average="micro", zero_division=0),
        "macro_f1": f1_score(gold, preds, average="macro", zero_division=0),
    }


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    seed_all(cfg.seed)

    ds = load_dataset("lex_glue", "ecthr_a")
    num_labels = ds["train"].features["labels"].feature.num_classes
    tokenizer = AutoTokenizer.from_pretrained(cfg.encoder)
    collator = ParagraphCollator(tokenizer, cfg.max_paragraphs, cfg.paragraph_len, num_labels)

    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(ds["validation"], shuffle=False)
    train_loader = DataLoader(ds["train"], batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=cfg.num_workers, pin_memory=True)
    val_loader = DataLoader(ds["validation"], batch_size=cfg.batch_size, sampler=val_sampler,
                            collate_fn=collator, num_workers=cfg.num_workers)

    model = HierLegalBert(cfg, num_labels).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total_steps = len(train_loader) * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    loss_fn = nn.BCEWithLogitsLoss()
    scaler = torch.cuda.amp.GradScaler()

    best, bad_epochs = -1.0, 0
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["para_mask"])
            loss = loss_fn(logits.float(), batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % 50 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        metrics = evaluate(model.module, val_loader, device, world_size)
        logger.info("epoch %d val %s", epoch, metrics)
        # every rank sees the same gathered metrics, so they all stop together
        if metrics["micro_f1"] > best:
            best, bad_epochs = metrics["micro_f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(cfg.output_dir, "best_model.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= cfg.patience:
                logger.info("early stopping at epoch %d", epoch)
                break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
