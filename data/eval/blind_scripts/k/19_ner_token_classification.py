"""Named-entity recognition for customer e-mails (PERSON, ORG, ORDER_ID, PRODUCT, ADDRESS ...), BERT token
classification with plain DDP.

    torchrun --nproc_per_node=4 19_ner_token_classification.py --config configs/ner_emails.yaml
"""
import argparse
import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset, load_from_disk
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger("ner")


@dataclass
class NERConfig:
    model_name: str = "bert-base-cased"
    data_files: str = "data/ner_emails/{split}.jsonl"
    cache_dir: str = "cache/ner_emails_tokenized"
    max_len: int = 256
    batch_size: int = 16
    grad_accum: int = 2
    lr: float = 4e-5
    epochs: int = 6
    output_dir: str = "out/ner_emails"
    resume_from: str = ""


def tokenize_and_align(tokenizer, label2id, max_len):
    def fn(batch):
        enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
        all_labels = []
        for i, tags in enumerate(batch["tags"]):
            word_ids, prev, labels = enc.word_ids(i), None, []
            for w in word_ids:
                labels.append(-100 if w is None or w == prev else label2id[tags[w]])
                prev = w
            all_labels.append(labels)
        enc["labels"] = all_labels
        return enc
    return fn


def prepare_data(cfg, tokenizer, rank):
    """Rank 0 tokenizes and writes the Arrow cache; the others wait and then memory-map it."""
    if rank == 0 and not os.path.isdir(cfg.cache_dir):
        raw = load_dataset("json", data_files={s: cfg.data_files.format(split=s) for s in ("train", "dev")})
        labels = sorted({t for ex in raw["train"] for t in ex["tags"]})
        label2id = {l: i for i, l in enumerate(labels)}
        proc = raw.map(tokenize_and_align(tokenizer, label2id, cfg.max_len), batched=True,
                       remove_columns=["tokens", "tags"])
        proc.save_to_disk(cfg.cache_dir)
        with open(os.path.join(cfg.cache_dir, "labels.txt"), "w") as f:
            f.write("\n".join(labels))
    dist.barrier()
    ds = load_from_disk(cfg.cache_dir)
    labels = open(os.path.join(cfg.cache_dir, "labels.txt")).read().splitlines()
    return ds, labels


@torch.no_grad()
def evaluate(model, loader, id2label, device, world_size, rank):
    model.eval()
    local = []
    for batch in loader:
        idx = batch.pop("example_idx").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        for j, (p_row, l_row) in enumerate(zip(preds.tolist(), batch["labels"].tolist())):
            keep = [(id2label[p], id2label[l]) for p, l in zip(p_row, l_row) if l != -100]
            local.append((idx[j], [k[0] for k in keep], [k[1] for k in keep]))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if rank != 0:
        return None
    # DistributedSampler pads with repeated examples; keep each example once
    unique = {i: (p, r) for part in gathered for i, p, r in part}
    preds, refs = zip(*unique.values())
    return f1_score(list(refs), list(preds))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = NERConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    ds, labels = prepare_data(cfg, tokenizer, rank)
    id2label = dict(enumerate(labels))
    ds["dev"] = ds["dev"].add_column("example_idx", list(range(len(ds["dev"]))))
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(ds["train"], shuffle=True, seed=7)
    train_loader = DataLoader(ds["train"], batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=collator,
                              num_workers=2)
    dev_loader = DataLoader(ds["dev"], batch_size=cfg.batch_size * 2, collate_fn=collator, num_workers=2,
                            sampler=DistributedSampler(ds["dev"], shuffle=False))

    model = AutoModelForTokenClassification.from_pretrained(
        cfg.model_name, num_labels=len(labels), id2label=id2label, label2id={l: i for i, l in id2label.items()})
    start_epoch = 0
    if cfg.resume_from:
        state = torch.load(cfg.resume_from, map_location="cpu")
        model.load_state_dict(state["model"])
        start_epoch = state["epoch"] + 1
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    updates = (len(train_loader) // cfg.grad_accum) * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * updates), updates)
    if cfg.resume_from:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    best_f1 = 0.0
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_update = (step + 1) % cfg.grad_accum == 0
            with contextlib.nullcontext() if is_update else model.no_sync():
                loss = model(**batch).loss / cfg.grad_accum
                loss.backward()
            if is_update:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        f1 = evaluate(model, dev_loader, id2label, device, world_size, rank)
        if rank == 0:
            logger.info("epoch %d dev entity-F1 %.4f", epoch, f1)
            os.makedirs(cfg.output_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(cfg.output_dir, "last.pt"))
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(os.path.join(cfg.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(cfg.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
